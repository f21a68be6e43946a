"""Pieces cut while the audio is still being read (asrserve/audio/piece_cutter.py) are exactly
those of cutting the whole audio, and a long upload's first pieces leave the preprocessing
pool before the file is decoded to its end."""

from __future__ import annotations

import asyncio
import io
import os
import sys
import threading

import numpy as np
import pytest
import soundfile

from asrserve.audio import decode, piece_cutter, vad
from asrserve.audio.chunking import ChunkingStrategy, cut_audio, split_audio
from asrserve.audio.decode import AudioError
from asrserve.audio.piece_cutter import PieceCutter
from asrserve.config import N_SAMPLES, SAMPLE_RATE
from asrserve.entrypoints.preprocess import PreprocessPool
from tests.test_vad import needs_silero

SR = SAMPLE_RATE


@pytest.fixture(scope="module")
def long_audio(speech_audio) -> np.ndarray:
    """~6 minutes over low noise: sentences with pauses of 0.1-4 s, a stretch of over 40 s
    without a pause Silero would end speech at, two minutes of silence, a last sentence at the
    very end (no padding room after it)."""
    rng = np.random.default_rng(7)
    parts = [np.zeros(SR // 3, np.float32)]
    for i in range(40):
        parts += [speech_audio[i % len(speech_audio)], np.zeros(int(rng.uniform(0.1, 4.0) * SR), np.float32)]
    run = np.concatenate([clip[: len(clip) - SR // 20] for clip in speech_audio * 4])  # no pause of 200 ms
    parts += [run[: 45 * SR], np.zeros(120 * SR, np.float32), speech_audio[1]]
    audio = np.concatenate(parts)
    return audio + rng.normal(0, 1e-4, len(audio)).astype(np.float32)


def _read_in_steps(cutter: PieceCutter, audio: np.ndarray, seed: int) -> tuple[list, int]:
    """Feeds growing prefixes the way a decoder's blocks arrive (sizes from one MP3 frame to
    ~10 s); returns every piece and how many came before the end."""
    rng = np.random.default_rng(seed)
    pieces, length = [], 0
    while length < len(audio):
        length = min(len(audio), length + int(rng.choice([1152, 4096, 48_000, 160_000])))
        pieces += cutter.feed(audio[:length])
    early = len(pieces)
    return pieces + cutter.finish(audio), early


def _bounds(pieces) -> list[tuple[int, int]]:
    return [(piece.offset, len(piece.samples)) for piece in pieces]


@needs_silero
@pytest.mark.parametrize("block_windows", [vad.BLOCK_WINDOWS, 96])
@pytest.mark.parametrize(
    "strategy",
    [(ChunkingStrategy("server_vad"), None), (ChunkingStrategy("server_vad", 0.6, 500, 700), None),
     (ChunkingStrategy("server_vad"), 1500), (ChunkingStrategy("energy"), None)],
    ids=["vad-default", "vad-options", "vad-max-gap", "energy"],
)
def test_pieces_cut_while_reading_are_those_of_the_whole(long_audio, strategy, block_windows, monkeypatch):
    strategy, max_gap_ms = strategy
    monkeypatch.setattr(vad, "BLOCK_WINDOWS", block_windows)  # more blocks: more prefixes cut
    monkeypatch.setattr(piece_cutter, "MAX_GAP_MS", max_gap_ms)  # benchmarks/vad_cut_choices.py's knob
    if strategy.type == "energy":
        whole = split_audio(long_audio)
    else:
        options = dict(threshold=strategy.threshold, prefix_padding_ms=strategy.prefix_padding_ms,
                       silence_duration_ms=strategy.silence_duration_ms)
        whole = vad.vad_pieces(long_audio, max_gap_ms=max_gap_ms,
                               **{name: value for name, value in options.items() if value is not None})
    assert len(whole) >= 10 and _bounds(cut_audio(long_audio, strategy)) == _bounds(whole)
    for seed in range(3):
        pieces, early = _read_in_steps(PieceCutter(strategy), long_audio, seed)
        assert _bounds(pieces) == _bounds(whole)
        assert all(np.array_equal(a.samples, long_audio[a.offset : a.offset + len(a.samples)]) for a in pieces)
        # Pieces go while reading: all but those of the last minute or so.
        assert early >= len(whole) - 4, (early, len(whole))


@needs_silero
def test_audio_of_30_s_or_less_is_one_piece_only_at_the_end(speech_audio):
    audio = np.concatenate(speech_audio)[:N_SAMPLES]
    cutter = PieceCutter(ChunkingStrategy("server_vad"))
    assert all(cutter.feed(audio[:length]) == [] for length in range(4096, len(audio), 4096))
    assert _bounds(cutter.finish(audio)) == [(0, N_SAMPLES)]


@needs_silero
def test_a_short_file_that_opens_on_a_pause_is_decoded_from_its_first_speech(speech_audio):
    """Whisper times a window's first segment in its first second, whatever pause it opens on:
    a file of 30 s or less starts, as a VAD piece does, at its first speech less the padding."""
    speech = speech_audio[1]
    rng = np.random.default_rng(3)
    # (The last: noise at -60 dBFS before two seconds of speech, most of the file and its usual level.)
    for lead_s, quiet, said in ((20, np.zeros(20 * SR, np.float32), speech),
                                (6, rng.normal(0, 1e-3, 6 * SR).astype(np.float32), speech),
                                (27, rng.normal(0, 1e-3, 27 * SR).astype(np.float32), speech[: 2 * SR])):
        audio = np.concatenate([quiet, said])
        for strategy in (ChunkingStrategy("server_vad"), ChunkingStrategy("server_vad", prefix_padding_ms=800)):
            (piece,) = PieceCutter(strategy).finish(audio)
            padding = (strategy.prefix_padding_ms or 300) / 1000
            assert (lead_s - padding - 0.3) * SR <= piece.offset <= (lead_s - padding + 0.3) * SR, (lead_s, piece.offset)
            assert piece.offset + len(piece.samples) == len(audio)  # to the end, as before
        # The energy strategy runs no VAD: the whole file, as before.
        assert PieceCutter(ChunkingStrategy("energy")).finish(audio)[0].offset == 0
    # Speech from the start, or after a pause too short for Whisper to mistime: the whole file.
    for lead_s in (0.0, 0.8):
        audio = np.concatenate([np.zeros(int(lead_s * SR), np.float32), speech])
        assert PieceCutter(ChunkingStrategy("server_vad")).finish(audio)[0].offset == 0


def _flac(audio: np.ndarray) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, audio, SR, format="FLAC")
    return buffer.getvalue()


@needs_silero
def test_the_pool_sends_the_first_pieces_before_the_file_is_read(long_audio, monkeypatch):
    monkeypatch.setattr(decode, "BLOCK_SAMPLES", 10 * SR)  # the decoder's steps
    pool = PreprocessPool(num_workers=1, max_duration_s=None)

    async def run():
        prepared = await pool.prepare(_flac(long_audio))
        first, batches = list(prepared.pieces), 1
        assert not prepared.complete and first and prepared.duration_s is None
        assert prepared.expected_s == pytest.approx(len(long_audio) / SR, abs=0.1)  # the header's length
        while await prepared.more() is not None:
            batches += 1
        return prepared, first, batches

    try:
        prepared, first, batches = asyncio.run(run())
    finally:
        pool.shutdown()
    assert batches > 3 and prepared.complete
    assert prepared.duration_s == pytest.approx(len(long_audio) / SR, abs=1e-3)
    whole = cut_audio(decode.load_audio(_flac(long_audio)), ChunkingStrategy("server_vad"))
    assert _bounds(prepared.pieces) == _bounds(whole) and all(a is b for a, b in zip(prepared.pieces, first))


@needs_silero
def test_bad_audio_after_the_first_pieces_is_raised_to_the_reader(long_audio, monkeypatch):
    """NaN samples two minutes in: the pieces before them go, then the error, and no piece
    holding a NaN is ever sent (the engine never sees one)."""
    monkeypatch.setattr(decode, "BLOCK_SAMPLES", 10 * SR)
    broken = long_audio.copy()
    broken[120 * SR] = np.nan
    buffer = io.BytesIO()
    soundfile.write(buffer, broken, SR, format="WAV", subtype="FLOAT")
    pool = PreprocessPool(num_workers=1, max_duration_s=None)

    async def run():
        prepared = await pool.prepare(buffer.getvalue())
        with pytest.raises(AudioError, match="NaN"):
            while await prepared.more() is not None:
                pass
        return prepared

    try:
        prepared = asyncio.run(run())
    finally:
        pool.shutdown()
    assert prepared.pieces and not prepared.complete
    assert all(np.isfinite(piece.samples).all() for piece in prepared.pieces)
    assert max(piece.offset + len(piece.samples) for piece in prepared.pieces) <= 120 * SR


def _random_probabilities(rng) -> np.ndarray:
    """Runs of speech (up to ~40 s) and pauses (32 ms to 3 s), some of them borderline."""
    runs = []
    while sum(map(len, runs)) < 6000:  # ~3 minutes of windows
        runs.append(np.full(int(rng.integers(3, 1250)), rng.choice([0.9, 0.55])))
        runs.append(np.full(int(rng.integers(1, 100)), rng.choice([0.05, 0.3, 0.45])))
    return np.concatenate(runs).astype(np.float32)


@pytest.mark.parametrize("padding_ms, max_gap_ms, lookback_ms", [
    (300, None, None), (30, None, None), (1000, None, None), (300, 1500, None),
    (300, None, 10_000), (30, None, 29_000), (1000, 1500, 5_000)])
def test_only_a_prefix_s_last_two_vad_pieces_can_change(padding_ms, max_gap_ms, lookback_ms):
    """The locality the cutter relies on (vad_regions.piece_spans), over random probabilities
    and prefixes ending anywhere: every span of a prefix but its last two is a span of the
    whole, whatever comes after."""
    from asrserve.audio.vad_regions import WINDOW

    rng = np.random.default_rng(padding_ms)
    for _ in range(40):
        probs = _random_probabilities(rng)
        samples = rng.normal(0, 0.1, len(probs) * WINDOW).astype(np.float32)
        spans = _prefix_spans(probs, samples, len(probs), padding_ms, max_gap_ms=max_gap_ms, lookback_ms=lookback_ms)
        for windows in rng.integers(1, len(probs), 30):
            settled = _prefix_spans(probs, samples, int(windows), padding_ms, max_gap_ms=max_gap_ms,
                                    lookback_ms=lookback_ms)[:-2]
            assert settled == spans[: len(settled)]


def _prefix_spans(probs: np.ndarray, samples: np.ndarray, windows: int, padding_ms: float, **options):
    """piece_spans of the audio's first `windows` windows, as the cutter computes them."""
    from asrserve.audio.vad_regions import WINDOW, RegionFinder, piece_spans

    finder = RegionFinder(0.5, 200, 100)
    finder.feed(probs[:windows])
    end = windows * WINDOW
    return piece_spans(finder.regions + finder.open_region(end), probs[:windows], samples[:end], end, padding_ms,
                       **options)


def test_a_blip_the_whole_audio_drops_does_not_move_a_cut_in_a_prefix():
    """The counterexample a review found to the lookback cut's locality: speech at 0.5-21,
    23-29 and 29.5-52.5 s, then a 64 ms blip (a region while the prefix ends in it, dropped as
    too short by the whole audio) and speech again at 60 s. The blip pulled the region before
    it in by half the gap, and a prefix moved a cut the whole audio did not: three pieces from
    the end, a 500 for the upload ("pieces sent early ... differ")."""
    from asrserve.audio.vad_regions import WINDOW

    def window(seconds: float) -> int:
        return int(round(seconds * SR / WINDOW))

    blip = 52.5 + 0.2 + 0.064
    probs = np.zeros(window(80.0), np.float32)
    for start, end in [(0.5, 21.0), (23.0, 29.0), (29.5, 52.5), (blip, blip + 0.064), (60.0, 70.0)]:
        probs[window(start) : window(end)] = 0.9
    samples = np.zeros(len(probs) * WINDOW, np.float32)
    whole = _prefix_spans(probs, samples, len(probs), 300)
    for windows in range(1, len(probs)):
        settled = _prefix_spans(probs, samples, windows, 300)[:-2]
        assert settled == whole[: len(settled)], windows * WINDOW / SR


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="thread niceness is set on Linux only")
def test_preprocessing_threads_yield_the_cpu_to_the_engine(monkeypatch):
    from asrserve.entrypoints import preprocess

    seen = []

    def load_audio(data, max_duration_s=None, on_progress=None):
        seen.append(os.getpriority(os.PRIO_PROCESS, threading.get_native_id()))
        return np.zeros(SR, np.float32)

    monkeypatch.setattr(preprocess, "load_audio", load_audio)
    pool = PreprocessPool(num_workers=1, max_duration_s=None)
    try:
        for _ in range(3):  # the thread is reused: its niceness is raised once
            asyncio.run(pool.prepare(b"x"))
    finally:
        pool.shutdown()
    assert seen == [os.getpriority(os.PRIO_PROCESS, 0) + preprocess.PREPROCESS_NICENESS] * 3
