"""Splits audio longer than 30 s into pieces the encoder can take, cutting where it is quiet.

For each 30 s span we look at its last second in 100 ms windows (sliding by 10 ms) and cut at
the middle of the window with the least energy, so cuts land in pauses rather than in words.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from asrserve.config import N_SAMPLES, SAMPLE_RATE

SEARCH_SAMPLES = SAMPLE_RATE  # the last second of each span
WINDOW_SAMPLES = SAMPLE_RATE // 10  # 100 ms
HOP_SAMPLES = SAMPLE_RATE // 100  # 10 ms


@dataclass(frozen=True)
class AudioPiece:
    offset: int  # first sample of the piece in the whole audio
    samples: np.ndarray

    @property
    def start_seconds(self) -> float:
        return self.offset / SAMPLE_RATE


def split_audio(audio: np.ndarray, max_samples: int = N_SAMPLES) -> list[AudioPiece]:
    pieces = []
    start = 0
    while len(audio) - start > max_samples:
        cut = start + _quietest_point(audio[start + max_samples - SEARCH_SAMPLES : start + max_samples])
        cut += max_samples - SEARCH_SAMPLES
        pieces.append(AudioPiece(start, audio[start:cut]))
        start = cut
    pieces.append(AudioPiece(start, audio[start:]))
    return pieces


def _quietest_point(region: np.ndarray) -> int:
    """Offset in `region` of the centre of its lowest-RMS 100 ms window."""
    energy = np.concatenate([[0.0], np.cumsum(region.astype(np.float64) ** 2)])
    starts = np.arange(0, len(region) - WINDOW_SAMPLES + 1, HOP_SAMPLES)
    window_energy = energy[starts + WINDOW_SAMPLES] - energy[starts]
    return int(starts[np.argmin(window_energy)]) + WINDOW_SAMPLES // 2
