"""What callers of the offline API pass as audio: one input or many, checked, as a list (or,
for a generator without per-input languages, as it came, read lazily)."""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from pathlib import Path

import numpy as np

from asrserve.audio.decode import is_tensor
from asrserve.engine.request_checks import check_languages
from asrserve.errors import InvalidRequestError, shown


def is_single(audio) -> bool:
    return isinstance(audio, (str, Path, bytes, bytearray, np.ndarray)) or hasattr(audio, "read") or is_tensor(audio)


def input_sources(audio, language) -> Iterable:
    """`audio` as inputs: a list, or the iterable itself where it has no length and one
    language is given for all (a generator of files is read as the engine makes room)."""
    # (a dict was read as a list of its keys, each a file name; a memoryview as a list of numbers)
    if audio is None or isinstance(audio, (bool, int, float, np.generic, dict, memoryview)):
        raise InvalidRequestError(f"audio must be a path, bytes, a file, an array or a list of them, got {shown(audio)}")
    if is_single(audio):
        return [audio]
    if isinstance(audio, (list, tuple)) and audio and isinstance(audio[0], (int, float, np.number)):
        # (each number would be read as an input of its own, and fail as one)
        raise InvalidRequestError("a list of numbers is a list of inputs: pass samples as a numpy array")
    if not (language is None or isinstance(language, str)) and not hasattr(audio, "__len__"):
        return list(audio)  # one language per input: counted against the inputs
    return audio


def input_languages(engine, language: str | Sequence[str | None] | None, languages: Sequence[str],
                    num_sources: int | None, task: str):
    """(the checked language code, or None, of input i as a function of i; the languages a
    detection may pick, checked: empty for any)."""
    def check(code: str | None) -> str | None:  # ("" is none, as an empty form field or -l "")
        return check_languages(engine.tokenizer, engine.model_name, code or None, languages, task)[0]

    choice = check_languages(engine.tokenizer, engine.model_name, None, languages, task)[1]
    if language is None or isinstance(language, str):
        code = check(language)
        return (lambda index: code), choice
    if not isinstance(language, Iterable):
        raise InvalidRequestError(f"language must be a code, None or one of them per input, got {language!r}")
    codes = list(language)
    if len(codes) != num_sources:
        raise InvalidRequestError(f"language: {len(codes)} codes for {num_sources} inputs")
    return [check(code) for code in codes].__getitem__, choice
