"""Errors a user can cause. Their messages are one line and safe to show (HTTP 4xx)."""

import reprlib
from typing import Any

from asrserve.audio.decode import AudioError


def cut(text: str, limit: int = 40) -> str:
    """A user's text cut short for a message: messages name the problem, they do not echo
    kilobytes of input back."""
    return text if len(text) <= limit else text[:limit] + "..."


def shown(value: Any, limit: int = 40) -> str:
    """A user's value quoted for an error message, cut short (cut), nor a JSON value nested
    thousands deep written out whole."""
    if isinstance(value, str):
        return repr(cut(value, limit))
    short = reprlib.Repr()  # (its settings are not constructor arguments before Python 3.12)
    short.maxlevel, short.maxlist, short.maxdict = 2, 4, 4
    short.maxstring = short.maxother = short.maxlong = limit
    return short.repr(value)


class InvalidRequestError(ValueError):
    """A request the engine refuses: bad audio, language, task or parameter (`param`: the
    request field at fault, where it is known)."""

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class ModelLoadError(Exception):
    """A model that cannot be found or read. The message is one line, fit for users."""


__all__ = ["AudioError", "InvalidRequestError", "ModelLoadError", "shown"]
