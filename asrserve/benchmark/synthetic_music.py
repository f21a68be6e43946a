"""Music without a recording: piano-like chords under drum hits, for checks and benchmarks of
what the server writes over music beside speech (no music ships with the repository)."""

from __future__ import annotations

import numpy as np

SAMPLE_RATE = 16_000
CHORDS = ([261.6, 329.6, 392.0], [220.0, 261.6, 329.6], [174.6, 220.0, 261.6], [196.0, 246.9, 293.7])  # C Am F G


def music(seconds: int, seed: int = 0, level_db: float = -18.0) -> np.ndarray:
    """One chord a second (four harmonics each, decaying), a drum hit every half second (noise
    bursts, a low thump on the beat), at `level_db` dBFS RMS, 16 kHz float32."""
    rng = np.random.default_rng(seed)
    t = np.arange(SAMPLE_RATE) / SAMPLE_RATE
    out = np.zeros(seconds * SAMPLE_RATE)
    for second in range(seconds):
        span = slice(second * SAMPLE_RATE, (second + 1) * SAMPLE_RATE)
        for frequency in CHORDS[second % len(CHORDS)]:
            for harmonic in range(1, 5):
                out[span] += np.exp(-2 * t) * np.sin(2 * np.pi * frequency * harmonic * t) / harmonic
    hit = SAMPLE_RATE // 8
    for beat in range(2 * seconds):
        start = beat * SAMPLE_RATE // 2
        out[start : start + hit] += rng.standard_normal(hit) * np.exp(-30 * t[:hit]) * (1.5 if beat % 2 else 0.8)
        if beat % 2 == 0:
            out[start : start + hit] += 2 * np.sin(2 * np.pi * 60 * t[:hit]) * np.exp(-20 * t[:hit])
    return (out / np.sqrt(np.mean(out**2)) * 10 ** (level_db / 20)).astype(np.float32)
