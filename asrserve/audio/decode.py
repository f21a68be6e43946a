"""Audio in, 16 kHz mono float32 out: decode, mix down, resample, validate."""

from __future__ import annotations

import io
from pathlib import Path
from typing import BinaryIO, Union

import numpy as np
import soundfile
import soxr

from asrserve.config import SAMPLE_RATE

AudioSource = Union[str, Path, bytes, bytearray, BinaryIO, np.ndarray]


class AudioError(ValueError):
    """The audio cannot be transcribed: unreadable, empty or not finite. Safe to show users."""


def load_audio(source: AudioSource, sample_rate: int | None = None) -> np.ndarray:
    """Decodes a file, its bytes, or an array into 16 kHz mono float32.

    An array is taken as samples at `sample_rate` (16 kHz when not given), shaped [samples]
    or [samples, channels].
    """
    if isinstance(source, np.ndarray):
        samples, rate = source, sample_rate or SAMPLE_RATE
    else:
        samples, rate = _decode(source)
    return to_model_input(samples, rate)


def to_model_input(samples: np.ndarray, sample_rate: int) -> np.ndarray:
    samples = np.asarray(samples)
    if samples.ndim == 2:
        samples = samples.mean(axis=1)  # mix every channel down to mono
    if samples.ndim != 1:
        raise AudioError(f"audio must be [samples] or [samples, channels], got shape {samples.shape}")
    if samples.size == 0:
        raise AudioError("audio is empty: it has no samples")
    if np.issubdtype(samples.dtype, np.integer):
        # PCM integers: full scale maps to [-1, 1)
        samples = samples.astype(np.float32) / float(np.iinfo(samples.dtype).max + 1)
    elif not np.issubdtype(samples.dtype, np.floating):
        raise AudioError(f"audio samples must be numbers, got {samples.dtype}")
    samples = samples.astype(np.float32, copy=False)
    if not np.isfinite(samples).all():
        raise AudioError("audio contains NaN or infinite samples")
    if sample_rate != SAMPLE_RATE:
        samples = soxr.resample(samples, sample_rate, SAMPLE_RATE, quality="HQ").astype(np.float32, copy=False)
    return np.ascontiguousarray(samples)


def _decode(source: str | Path | bytes | bytearray | BinaryIO) -> tuple[np.ndarray, int]:
    if isinstance(source, (bytes, bytearray)):
        if len(source) == 0:
            raise AudioError("audio is empty: the file has no bytes")
        source = io.BytesIO(source)
    elif isinstance(source, (str, Path)) and not Path(source).is_file():
        raise AudioError(f"audio file not found: {source}")
    try:
        samples, rate = soundfile.read(source, dtype="float32", always_2d=True)
    except (soundfile.LibsndfileError, RuntimeError, TypeError, ValueError) as error:
        raise AudioError(f"could not decode audio: {_one_line(error)}") from None
    if rate <= 0:
        raise AudioError(f"audio has an invalid sample rate {rate}")
    return samples, rate


def _one_line(error: Exception) -> str:
    return " ".join(str(error).split()) or type(error).__name__
