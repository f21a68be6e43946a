"""Checks on what a user asks for, shared by the engine core and the HTTP server (which runs
them before any audio work, so a bad language costs nothing)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np

from asrserve.config import N_SAMPLES, SAMPLE_RATE
from asrserve.errors import InvalidRequestError, shown
from asrserve.model.languages import LANGUAGES, normalize_language
from asrserve.model.tokenizer import WhisperTokenizer

TASKS = ("transcribe", "translate")
# Audio whose samples all lie within a span this narrow holds no sound: zeros, G.711 A-law's
# idle code (it has no zero: silence decodes to a constant 8 steps of 16-bit PCM), a constant
# offset, the last bit of a 16-bit recording flickering. Whisper's log-mel is normalised to its
# loudest frame, so it would magnify such audio into noise and hallucinate words ("you",
# "Thank you.") from it. (Eight steps: resampled from 8 kHz, A-law's idle code rings to 4-9
# steps at the file's ends; real speech recorded 68 dB down, 26 steps from trough to peak, is
# still read word for word.)
DIGITAL_SILENCE_SPAN = 8.0 / 32768
# A resampled file rings for up to 5 ms at each end (soxr's filter starts and ends on zeros): a
# constant offset of 1000 steps at 44.1-192 kHz spans 430-550 steps there, 635 from 8 kHz, and
# reached the model ("you"). The span is measured inside them.
RESAMPLED_EDGE_SAMPLES = SAMPLE_RATE // 100
# Nor does audio shorter than this hold a word (OpenAI's API refuses audio under 0.1 s): a click
# of a few samples, normalised the same way, read as "you".
MIN_SPEECH_SAMPLES = SAMPLE_RATE // 10


def check_language(tokenizer: WhisperTokenizer, model_name: str, language: str | None, task: str) -> str | None:
    """Normalises the language code and checks that the model can do the task in it."""
    if task not in TASKS:
        raise InvalidRequestError(f"task must be one of {', '.join(TASKS)}, got {shown(task)}")
    if not tokenizer.is_multilingual and task == "translate":
        raise InvalidRequestError(
            f"{model_name} is an English-only model and cannot translate; use a multilingual model", param="model"
        )
    if language is None:
        return None
    code = normalize_language(language)
    if code is None:
        raise InvalidRequestError(f"unsupported language {shown(language)}; use an ISO-639-1 code such as 'en'",
                                  param="language")
    if code not in tokenizer.languages:
        if not tokenizer.is_multilingual:
            raise InvalidRequestError(
                f"{model_name} is an English-only model; it cannot transcribe {LANGUAGES[code]} ({code})",
                param="language",
            )
        raise InvalidRequestError(f"{model_name} does not know the language {code!r}", param="language")
    return code


def check_languages(
    tokenizer: WhisperTokenizer, model_name: str, language: str | None, languages: Sequence[str], task: str,
) -> tuple[str | None, tuple[str, ...]]:
    """A request's language and OpenAI's `languages` (those the audio may be in) -> the language
    to decode in (None: detect it) and the languages a detection may pick (empty: any). One
    language listed is the language; a language given must be among those listed."""
    if isinstance(languages, str) or not all(isinstance(each, str) for each in languages):
        raise InvalidRequestError("languages must be a list of language codes", param="languages")
    try:
        codes = tuple(dict.fromkeys(check_language(tokenizer, model_name, each, task) for each in languages))
    except InvalidRequestError as error:
        if error.param == "model":  # (an English-only model cannot translate, whatever the languages)
            raise
        raise InvalidRequestError(f"languages: {error}", param="languages") from None
    language = check_language(tokenizer, model_name, language, task)
    if language is not None:
        if codes and language not in codes:
            raise InvalidRequestError(f"language {language!r} is not among languages {list(codes)}", param="language")
        return language, ()
    return (codes[0], ()) if len(codes) == 1 else (None, codes)


def check_audio_piece(audio: np.ndarray) -> None:
    """One engine request's audio: 16 kHz mono float32, finite, at most 30 s."""
    if not isinstance(audio, np.ndarray) or audio.ndim != 1 or audio.dtype != np.float32:
        raise InvalidRequestError("audio must be a 1-D float32 array of 16 kHz samples")
    if audio.size == 0:
        raise InvalidRequestError("audio is empty: it has no samples")
    if audio.size > N_SAMPLES:
        raise InvalidRequestError(
            f"audio is {audio.size / SAMPLE_RATE:.1f} s long; one engine request takes at most "
            f"{N_SAMPLES // SAMPLE_RATE} s (split longer audio first)"
        )
    if not np.isfinite(audio).all():
        raise InvalidRequestError("audio contains NaN or infinite samples")


def holds_no_speech(audio: np.ndarray) -> bool:
    """Digital silence (its first and last 10 ms aside), or too short for a word: answered as
    silence, without the model."""
    if audio.size < MIN_SPEECH_SAMPLES:
        return True
    inside = audio[RESAMPLED_EDGE_SAMPLES:-RESAMPLED_EDGE_SAMPLES]
    return float(inside.max()) - float(inside.min()) < DIGITAL_SILENCE_SPAN
