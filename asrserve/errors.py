"""Errors a user can cause. Their messages are one line and safe to show (HTTP 4xx)."""

from asrserve.audio.decode import AudioError


def shown(value: str, limit: int = 40) -> str:
    """A user's value quoted for an error message, cut short: messages name the problem, they
    do not echo kilobytes of input back."""
    return repr(value if len(value) <= limit else value[:limit] + "...")


class InvalidRequestError(ValueError):
    """A request the engine refuses: bad audio, language, task or parameter."""


class ModelLoadError(Exception):
    """A model that cannot be found or read. The message is one line, fit for users."""


__all__ = ["AudioError", "InvalidRequestError", "ModelLoadError", "shown"]
