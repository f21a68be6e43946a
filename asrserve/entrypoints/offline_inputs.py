"""What callers of the offline API pass as audio: one input or many, checked, as a list (or,
for a generator without per-input languages, as it came, read lazily)."""

from __future__ import annotations

from collections.abc import Iterable
from pathlib import Path

import numpy as np

from asrserve.errors import InvalidRequestError


def is_single(audio) -> bool:
    return isinstance(audio, (str, Path, bytes, bytearray, np.ndarray)) or hasattr(audio, "read")


def input_sources(audio, language) -> Iterable:
    """`audio` as inputs: a list, or the iterable itself where it has no length and one
    language is given for all (a generator of files is read as the engine makes room)."""
    if audio is None or isinstance(audio, (bool, int, float, np.generic)):
        raise InvalidRequestError(f"audio must be a path, bytes, a file, an array or a list of them, got {audio!r}")
    if is_single(audio):
        return [audio]
    if isinstance(audio, (list, tuple)) and audio and isinstance(audio[0], (int, float, np.number)):
        # (each number would be read as an input of its own, and fail as one)
        raise InvalidRequestError("a list of numbers is a list of inputs: pass samples as a numpy array")
    if not (language is None or isinstance(language, str)) and not hasattr(audio, "__len__"):
        return list(audio)  # one language per input: counted against the inputs
    return audio
