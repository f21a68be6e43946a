"""Splits audio longer than 30 s into pieces the encoder can take.

Two strategies. "energy" (split_audio): for each 30 s span we look at its last second in
100 ms windows (sliding by 10 ms) and cut at the middle of the window with the least energy, so
cuts land in pauses rather than in words; every sample is decoded. "vad" (OpenAI's server_vad,
asrserve.audio.vad): Silero VAD finds the speech, regions are merged into pieces of at most
30 s, and long non-speech between pieces is never decoded.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np

from asrserve.config import N_SAMPLES, SAMPLE_RATE
from asrserve.errors import shown

SEARCH_SAMPLES = SAMPLE_RATE  # the last second of each span
WINDOW_SAMPLES = SAMPLE_RATE // 10  # 100 ms
HOP_SAMPLES = SAMPLE_RATE // 100  # 10 ms


CHUNKING_TYPES = ("energy", "server_vad")


@dataclass(frozen=True)
class ChunkingStrategy:
    """How audio longer than 30 s is cut. type "server_vad" takes OpenAI's fields: the speech
    probability threshold, the padding kept before speech, and the silence that ends a speech
    region (None: asrserve.audio.vad's defaults)."""

    type: str = "energy"
    threshold: float | None = None
    prefix_padding_ms: int | None = None
    silence_duration_ms: int | None = None

    @classmethod
    def parse(cls, value: "str | dict | ChunkingStrategy | None", default: "ChunkingStrategy") -> "ChunkingStrategy":
        """OpenAI's chunking_strategy: "auto" (voice activity, default settings), or
        {"type": "server_vad", "threshold", "prefix_padding_ms", "silence_duration_ms"} (a dict
        or its JSON text, as a form field or flag carries it); asrserve also takes "energy" (cut
        at quiet points) and "server_vad". None: `default`. Raises ValueError saying what is wrong."""
        if value is None:
            return default
        if isinstance(value, ChunkingStrategy):
            return value
        if isinstance(value, str) and value.strip().startswith("{"):
            try:
                value = json.loads(value)
            except json.JSONDecodeError as error:
                raise ValueError(f"not valid JSON: {error}") from None
            except RecursionError:  # nested thousands deep (a bug's 500 before)
                raise ValueError("not JSON we read: nested too deep") from None
        if isinstance(value, str):
            if value == "auto":
                return cls("server_vad")
            if value in CHUNKING_TYPES:
                return cls(value)
            raise ValueError(f"must be 'auto', 'energy' or an object with type 'server_vad', got {shown(value)}")
        if not isinstance(value, dict):
            raise ValueError("must be 'auto', 'energy' or an object with type 'server_vad'")
        unknown = set(value) - {"type", "threshold", "prefix_padding_ms", "silence_duration_ms"}
        if unknown:
            raise ValueError(f"unknown field {shown(sorted(unknown)[0])}")
        if value.get("type") not in CHUNKING_TYPES:
            raise ValueError(f"type must be 'server_vad' (or 'energy'), got {shown(value.get('type'))}")
        threshold = _number(value, "threshold", 0.0, 1.0, float)
        padding = _number(value, "prefix_padding_ms", 0, 10_000, int)
        silence = _number(value, "silence_duration_ms", 0, 10_000, int)
        return cls(value["type"], threshold, padding, silence)


# For requests and calls that name no strategy: chosen by measured WER and speed
# (docs/benchmarks.md#long-audio).
DEFAULT_CHUNKING = ChunkingStrategy("server_vad")


def _number(value: dict, name: str, low, high, kind):
    """value[name] as `kind` within [low, high], or None when absent."""
    raw = value.get(name)
    if raw is None:
        return None
    try:
        if isinstance(raw, bool) or (kind is int and float(raw) != int(float(raw))):
            raise ValueError
        number = kind(float(raw))
    except (TypeError, ValueError, OverflowError):  # OverflowError: int(inf)
        raise ValueError(f"{name} must be a number, got {shown(raw)}") from None
    if not low <= number <= high or number != number:
        raise ValueError(f"{name} must be between {low} and {high}, got {shown(raw)}")
    return number


@dataclass(frozen=True)
class AudioPiece:
    offset: int  # first sample of the piece in the whole audio
    samples: np.ndarray

    @property
    def start_seconds(self) -> float:
        return self.offset / SAMPLE_RATE


def cut_audio(audio: np.ndarray, strategy: ChunkingStrategy) -> list[AudioPiece]:
    """Pieces of at most 30 s. Audio of 30 s or less is one piece whatever the strategy.
    (asrserve.audio.piece_cutter gives the same pieces while the audio is still being read.)"""
    from asrserve.audio.piece_cutter import PieceCutter  # it imports this module

    return PieceCutter(strategy).finish(audio)


class QuietPointCut:
    """split_audio on audio still being read: cut(audio read so far) returns the pieces not
    given before that more audio cannot change (a cut needs only the 30 s after its piece's
    start); with final=True, the rest."""

    def __init__(self, max_samples: int = N_SAMPLES):
        self.max_samples = max_samples
        self.start = 0

    def cut(self, audio: np.ndarray, final: bool) -> list[AudioPiece]:
        pieces, start, limit = [], self.start, self.max_samples
        while len(audio) - start > limit:
            cut = start + limit - SEARCH_SAMPLES + quietest_point(audio[start + limit - SEARCH_SAMPLES : start + limit])
            pieces.append(AudioPiece(start, audio[start:cut]))
            start = cut
        if final:
            pieces.append(AudioPiece(start, audio[start:]))
        self.start = start
        return pieces


def split_audio(audio: np.ndarray, max_samples: int = N_SAMPLES) -> list[AudioPiece]:
    return QuietPointCut(max_samples).cut(audio, final=True)


def has_sound(region: np.ndarray, reference: np.ndarray) -> bool:
    """Whether `region` has a 100 ms window at least a tenth as loud (RMS) as the loud part of
    `reference` (its 90th-percentile window): speech rather than room noise or silence."""
    return first_sound(region, reference) is not None


def first_sound(region: np.ndarray, reference: np.ndarray) -> int | None:
    """Offset in `region` of its first 100 ms window that has_sound counts (None: none)."""
    region_rms = window_rms(region)
    reference_rms = window_rms(reference)
    if not len(region_rms) or not len(reference_rms):
        return None
    loud = np.flatnonzero((region_rms >= 0.1 * np.percentile(reference_rms, 90)) & (region_rms > 1e-4))
    return int(loud[0]) * WINDOW_SAMPLES if len(loud) else None


def window_rms(samples: np.ndarray) -> np.ndarray:
    """RMS of consecutive 100 ms windows."""
    count = len(samples) // WINDOW_SAMPLES
    windows = samples[: count * WINDOW_SAMPLES].astype(np.float64).reshape(count, WINDOW_SAMPLES)
    return np.sqrt((windows**2).mean(axis=1))


def quietest_point(region: np.ndarray, window: int = WINDOW_SAMPLES, hop: int = HOP_SAMPLES) -> int:
    """Offset in `region` of the centre of its lowest-energy window (`window` samples, tried
    every `hop`)."""
    window = min(window, len(region))
    energy = np.concatenate([[0.0], np.cumsum(region.astype(np.float64) ** 2)])
    starts = np.arange(0, len(region) - window + 1, hop)
    window_energy = energy[starts + window] - energy[starts]
    return int(starts[np.argmin(window_energy)]) + window // 2
