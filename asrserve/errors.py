"""Errors a user can cause. Their messages are one line and safe to show (HTTP 4xx later)."""

from asrserve.audio.decode import AudioError
from asrserve.model.loader import ModelLoadError


class InvalidRequestError(ValueError):
    """A request the engine refuses: bad audio, language, task or parameter."""


__all__ = ["AudioError", "InvalidRequestError", "ModelLoadError"]
