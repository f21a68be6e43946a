"""From Silero's per-window speech probabilities to speech regions and to pieces for Whisper:
the arithmetic after the model (asrserve.audio.vad). The region finder takes probabilities
block by block, so that a long upload's first pieces are known, and decoded, while the rest
of it is still being read (asrserve.audio.piece_cutter)."""

from __future__ import annotations

import math

import numpy as np

from asrserve.audio.chunking import quietest_point
from asrserve.config import N_SAMPLES, SAMPLE_RATE

WINDOW = 512  # samples per speech probability (32 ms at 16 kHz)
SPLIT_SEARCH_SAMPLES = 5 * SAMPLE_RATE  # where to look for a dip when speech runs past 30 s
QUIET_SAMPLES = SAMPLE_RATE // 50  # 20 ms: the span whose energy places a cut inside a dip
# A piece that is full ends at the longest pause that leaves it at most this many ms short of
# the limit, not at its last pause, if that one is more than LONGER_BY times as long
# (_cut_at_longest_pause; both measured in benchmarks/vad_cut_choices.py).
CUT_LOOKBACK_MS = 10_000
LONGER_BY = 2.0


class RegionFinder:
    """Unpadded [start, end) speech regions, as silero's get_speech_timestamps finds them
    (without max_speech): a region starts at a window with prob >= threshold and ends where
    min_silence_ms of prob < threshold - 0.15 begins; regions of at most min_speech_ms are
    dropped. Fed probabilities in order, any number at a time: `regions` holds those that
    have ended, and a region's end never depends on probabilities after it."""

    def __init__(self, threshold: float, min_silence_ms: float, min_speech_ms: float):
        self.threshold = threshold
        self.neg_threshold = max(threshold - 0.15, 0.01)
        self.min_silence = SAMPLE_RATE * min_silence_ms / 1000
        self.min_speech = SAMPLE_RATE * min_speech_ms / 1000
        self.regions: list[list[int]] = []
        self.num_windows = 0
        self._triggered, self._start, self._silence_start = False, 0, 0

    def feed(self, probs: np.ndarray) -> None:
        triggered, start, silence_start = self._triggered, self._start, self._silence_start
        position = self.num_windows * WINDOW
        for prob in np.asarray(probs, dtype=np.float64).tolist():
            if prob >= self.threshold:
                silence_start = 0
                if not triggered:
                    triggered, start = True, position
            elif triggered and prob < self.neg_threshold:
                if not silence_start:
                    silence_start = position
                if position - silence_start >= self.min_silence:
                    if silence_start - start > self.min_speech:
                        self.regions.append([start, silence_start])
                    triggered, silence_start = False, 0
            position += WINDOW
        self.num_windows += len(probs)
        self._triggered, self._start, self._silence_start = triggered, start, silence_start

    def open_region(self, num_samples: int) -> list[list[int]]:
        """The region still going on at num_samples (the end of the audio, or of what has been
        read so far), if it is long enough to count: [] or [[start, num_samples]]."""
        if self._triggered and num_samples - self._start > self.min_speech:
            return [[self._start, num_samples]]
        return []


def raw_regions(probs, num_samples, threshold, min_silence_ms, min_speech_ms) -> list[list[int]]:
    finder = RegionFinder(threshold, min_silence_ms, min_speech_ms)
    finder.feed(probs)
    return finder.regions + finder.open_region(num_samples)


def pad_regions(regions: list[list[int]], num_samples: int, speech_pad_ms: float) -> list[tuple[int, int]]:
    """Pads each region on both sides; neighbours closer than two pads meet halfway."""
    pad = SAMPLE_RATE * speech_pad_ms / 1000
    regions = [list(region) for region in regions]
    for i, region in enumerate(regions):
        if i == 0:
            region[0] = int(max(0, region[0] - pad))
        if i + 1 < len(regions):
            following = regions[i + 1]
            gap = following[0] - region[1]
            if gap < 2 * pad:
                region[1] += int(gap // 2)
                following[0] = int(max(0, following[0] - gap // 2))
            else:
                region[1] = int(min(num_samples, region[1] + pad))
                following[0] = int(max(0, following[0] - pad))
        else:
            region[1] = int(min(num_samples, region[1] + pad))
    return [(start, end) for start, end in regions]


def _split_long(start: int, end: int, probs: np.ndarray, samples: np.ndarray, limit: int) -> list[list[int]]:
    """Cuts an unpadded region longer than `limit` at its least speech-like window within the
    last few seconds before each limit: a pause too short to end the region, if there is one.
    Each cut depends only on the audio before it."""
    parts = []
    while end - start > limit:
        first = -(-max(start, start + limit - SPLIT_SEARCH_SAMPLES) // WINDOW)
        last = (start + limit) // WINDOW  # windows [first, last) lie inside the limit
        dip = first + int(np.argmin(probs[first:last]))
        # The probability lags the audio by a window or two, so the pause that made the dip
        # ends in the dip's window: cut at the quietest 20 ms of it and the two windows before.
        low, high = max(start + WINDOW, (dip - 2) * WINDOW), min(start + limit, (dip + 1) * WINDOW)
        if high > low:
            cut = low + quietest_point(samples[low:high], QUIET_SAMPLES, hop=1)
        else:
            cut = max(dip * WINDOW, start + WINDOW)
        parts.append([start, cut])
        start = cut
    parts.append([start, end])
    return parts


def piece_spans(
    raw: list[list[int]],
    probs: np.ndarray,
    samples: np.ndarray,
    num_samples: int,
    prefix_padding_ms: float,
    max_samples: int = N_SAMPLES,
    max_gap_ms: float | None = None,
    lookback_ms: float | None = CUT_LOOKBACK_MS,
) -> list[tuple[int, int]]:
    """[start, end) of the pieces the unpadded regions `raw` make (asrserve.audio.vad.vad_pieces
    says how), in order.

    Locality, which lets piece_cutter send pieces before the audio ends: a region's padded
    end depends on where the next one starts, and whether it joins the piece before on its
    own padded end. So with the regions of a prefix of the audio (the last one cut off where
    the prefix ends), every span but the last two is the same as with the whole audio: a
    piece is settled when a region does not fit in it, and moving its last regions on (below)
    opens one piece, as ending it there would."""
    pad = math.ceil(SAMPLE_RATE * prefix_padding_ms / 1000) + 1  # + 1: pad_regions rounds its ends
    if max_samples <= 2 * pad + 2 * WINDOW:
        raise ValueError(f"max_samples ({max_samples}) leaves no room for speech between the pads")
    # Split before padding, so that each part is still <= max_samples once padded and no cut
    # falls in the padding (which would leave a piece of bare silence).
    raw = [part for start, end in raw for part in _split_long(start, end, probs, samples, max_samples - 2 * pad)]
    padded = pad_regions(raw, num_samples, prefix_padding_ms)
    max_gap = math.inf if max_gap_ms is None else SAMPLE_RATE * max_gap_ms / 1000
    lookback = 0 if lookback_ms is None else SAMPLE_RATE * lookback_ms / 1000
    pieces: list[list[int]] = []  # the regions of each piece, by index
    for i, (start, end) in enumerate(padded):
        if pieces and raw[i][0] - raw[pieces[-1][-1]][1] < max_gap:
            piece = pieces[-1]
            if end - padded[piece[0]][0] <= max_samples:
                piece.append(i)  # WhisperX's cut & merge
                continue
            keep = _cut_at_longest_pause(piece, i, raw, padded, max_samples, lookback, pad)
            pieces[-1] = piece[:keep]
            pieces.append(piece[keep:] + [i])
            continue
        pieces.append([i])
    spans = [(padded[piece[0]][0], padded[piece[-1]][1]) for piece in pieces]
    return [(start, end) for start, end in spans if end > start]


def _cut_at_longest_pause(piece, following, raw, padded, max_samples, lookback, pad) -> int:
    """How many of a full piece's regions to keep when region `following` does not fit: all of
    them, or fewer where a pause over LONGER_BY times as long as the last one lies between two
    of them, leaving the piece at most `lookback` samples short of `max_samples` (the longest
    such), and the rest still fits with `following`. A piece that ends at the pause before its last words (a breath, or JFK's
    second inside "ask not ... what your country") leaves a sentence cut in two, and Whisper
    fills the end of a window cut mid-sentence with a loop of the words before. (Moving for a
    pause only a little longer than the last one costs a window now and then, and measured no
    better.)"""
    start = padded[piece[0]][0]
    best, longest = len(piece), LONGER_BY * (raw[following][0] - raw[piece[-1]][1])
    # Where `following` ends once padded, at the most: its padded end itself moves with the
    # region after it (pads meet halfway), which a prefix of the audio may not know yet (a
    # blip there that the whole audio drops); a move decided on it then differed from the
    # whole audio's, three pieces from the end.
    following_end = raw[following][1] + pad
    for keep in range(len(piece) - 1, 0, -1):
        if padded[piece[keep - 1]][1] - start < max_samples - lookback:
            break
        if following_end - padded[piece[keep]][0] > max_samples:
            break  # keeping fewer moves more on
        pause = raw[piece[keep]][0] - raw[piece[keep - 1]][1]
        if pause > longest:
            best, longest = keep, pause
    return best
