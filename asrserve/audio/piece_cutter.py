"""Cutting audio into pieces while it is still being decoded, so that the first pieces of a
long upload reach the engine before the rest is read: for an hour of MP3 on 2 cores, decoding
and voice-activity detection take ~3 s before the first piece could go otherwise.

feed() takes the samples decoded so far, again and again as they grow, and returns the pieces
that no later audio can change, each once; finish() takes the whole audio and returns the rest.
Together they are exactly the pieces of cutting the whole audio at once (chunking.cut_audio is
finish() alone), which tests/test_piece_cutter.py checks."""

from __future__ import annotations

import numpy as np

from asrserve.audio.chunking import WINDOW_SAMPLES, AudioPiece, ChunkingStrategy, QuietPointCut, window_rms
from asrserve.audio.vad_regions import CUT_LOOKBACK_MS, WINDOW, RegionFinder, piece_spans
from asrserve.config import N_SAMPLES, SAMPLE_RATE

SPANS_LEFT_OPEN = 2  # a prefix's last two VAD pieces may still change (vad_regions.piece_spans)
# A VAD piece also ends before a pause at least this long (None: pieces fill up to 30 s).
# Measured in benchmarks/vad_cut_choices.py, which sets it; not a default.
MAX_GAP_MS: float | None = None
# A full VAD piece ends at the longest pause in its last this many ms (None: at its last pause).
LOOKBACK_MS: float | None = CUT_LOOKBACK_MS
# A file of 30 s or less whose first LEADING_PAUSE_S are quieter than QUIET_LEAD times its
# loudest 100 ms (20 dB down) is decoded from its first speech (PieceCutter._speech_start), if
# that is at least MIN_LEAD_SKIPPED_S in.
LEADING_PAUSE_S = 1.5
QUIET_LEAD = 0.1
MIN_LEAD_SKIPPED_S = 1.0


class PieceCutter:
    def __init__(self, strategy: ChunkingStrategy):
        self.strategy = strategy
        self.sent: list[tuple[int, int]] = []  # (offset, length) of every piece given out
        self._quiet_points = QuietPointCut() if strategy.type == "energy" else None
        # Loaded once audio passes 30 s: a shorter file is one piece and needs no VAD, so it is
        # transcribed even where Silero cannot be loaded (vad.VADUnavailableError otherwise).
        self._vad_spans: _IncrementalVad | None = None

    def feed(self, samples: np.ndarray) -> list[AudioPiece]:
        """`samples`: 16 kHz mono float32 audio read so far, a longer prefix at every call."""
        if len(samples) <= N_SAMPLES:
            return []  # it may yet be one piece of 30 s or less
        if self._quiet_points is not None:
            return self._send(self._quiet_points.cut(samples, final=False))
        spans = self._vad().spans(samples, final=False)
        if spans is None:
            return []
        return self._send(_pieces(samples, spans[len(self.sent) : len(spans) - SPANS_LEFT_OPEN]))

    def finish(self, samples: np.ndarray) -> list[AudioPiece]:
        """The pieces of the whole audio `samples` not given by feed()."""
        if len(samples) <= N_SAMPLES:
            if self.sent:
                raise RuntimeError("pieces were sent for audio that turned out to be 30 s or less")
            start = self._speech_start(samples)
            return self._send([AudioPiece(start, samples[start:])])
        if self._quiet_points is not None:
            return self._send(self._quiet_points.cut(samples, final=True))
        spans = self._vad().spans(samples, final=True)
        sent = [(start, end - start) for start, end in spans[: len(self.sent)]]
        if sent != self.sent:  # a bug in the locality piece_spans relies on: fail, never send other text
            raise RuntimeError(f"pieces sent early {self.sent} differ from the whole audio's {sent}")
        return self._send(_pieces(samples, spans[len(self.sent) :]))

    def _speech_start(self, samples: np.ndarray) -> int:
        """Where a file of 30 s or less is decoded from: its start or, when it opens on a pause,
        its first speech less the padding, as long audio's VAD pieces start. Whisper puts a
        window's first timestamp in its first second, so a sentence after 20 s of quiet was
        timed 0.0-8.7 s (its words squashed into the end of that), and seek continuation then
        read it again where it is. An energy check comes first, so that most files never run
        Silero; one that opens quietly but with speech Silero hears keeps its start, and so does
        every file where Silero cannot be loaded or the strategy is energy. (Against the loudest
        window, not the file's usual level: where the pause is most of the file, noise at -60
        dBFS was its usual level, and tiny.en read the sentence four times into it.)"""
        rms = window_rms(samples)
        lead = round(LEADING_PAUSE_S * SAMPLE_RATE / WINDOW_SAMPLES)
        if self._quiet_points is not None or len(rms) <= lead or rms[:lead].max() >= QUIET_LEAD * rms.max():
            return 0
        try:
            spans = self._vad().spans(samples, final=True)
        except ImportError:  # vad.VADUnavailableError: no Silero in this install
            return 0
        start = spans[0][0] if spans else 0
        return start if start >= MIN_LEAD_SKIPPED_S * SAMPLE_RATE else 0

    def _vad(self) -> _IncrementalVad:
        if self._vad_spans is None:
            self._vad_spans = _IncrementalVad(self.strategy)
        return self._vad_spans

    def _send(self, pieces: list[AudioPiece]) -> list[AudioPiece]:
        self.sent += [(piece.offset, len(piece.samples)) for piece in pieces]
        return pieces


def _pieces(samples: np.ndarray, spans: list[tuple[int, int]]) -> list[AudioPiece]:
    return [AudioPiece(start, samples[start:end]) for start, end in spans]


class _IncrementalVad:
    """vad.vad_pieces' spans, with the model run block by block as the audio grows (blocks
    start at the same windows as over the whole audio, so the probabilities are the same)."""

    def __init__(self, strategy: ChunkingStrategy):
        from asrserve.audio import vad  # loads Silero on first use

        self.model = vad.get_vad()
        threshold = vad.DEFAULT_THRESHOLD if strategy.threshold is None else strategy.threshold
        silence_ms = vad.DEFAULT_SILENCE_DURATION_MS if strategy.silence_duration_ms is None else strategy.silence_duration_ms
        self.padding_ms = vad.DEFAULT_PREFIX_PADDING_MS if strategy.prefix_padding_ms is None else strategy.prefix_padding_ms
        self.block_windows = vad.BLOCK_WINDOWS
        self.finder = RegionFinder(threshold, silence_ms, vad.DEFAULT_MIN_SPEECH_MS)
        self.max_gap_ms, self.lookback_ms = MAX_GAP_MS, LOOKBACK_MS
        self.blocks: list[np.ndarray] = []
        self.lstm_state = None

    def spans(self, samples: np.ndarray, final: bool) -> list[tuple[int, int]] | None:
        """The spans of `samples` (the last SPANS_LEFT_OPEN unsettled unless final); None when
        not final and no new block of probabilities was complete."""
        samples = np.asarray(samples, dtype=np.float32)
        count = -(-len(samples) // WINDOW) if final else len(samples) // WINDOW  # whole windows only, until the end
        done = self.finder.num_windows
        if not final and count - done < self.block_windows:
            return None
        while done < count and (final or count - done >= self.block_windows):
            num = min(self.block_windows, count - done)
            probs, self.lstm_state = self.model.block_probabilities(samples, done, num, self.lstm_state)
            self.blocks.append(probs)
            self.finder.feed(probs)
            done += num
        probs = np.concatenate(self.blocks) if self.blocks else np.zeros(0, np.float32)
        end = len(samples) if final else done * WINDOW
        raw = self.finder.regions + self.finder.open_region(end)
        return piece_spans(raw, probs, samples, end, self.padding_ms, max_gap_ms=self.max_gap_ms,
                           lookback_ms=self.lookback_ms)
