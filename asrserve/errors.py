"""Errors a user can cause. Their messages are one line and safe to show (HTTP 4xx)."""

from asrserve.audio.decode import AudioError


class InvalidRequestError(ValueError):
    """A request the engine refuses: bad audio, language, task or parameter."""


class ModelLoadError(Exception):
    """A model that cannot be found or read. The message is one line, fit for users."""


__all__ = ["AudioError", "InvalidRequestError", "ModelLoadError"]
