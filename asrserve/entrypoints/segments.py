"""Segments and words from the pieces' timestamped tokens.

A piece's tokens read <|t0|> text <|t1|><|t1'|> text <|t2|> ...: each pair of timestamps
brackets one segment (times from the piece's start; the piece's offset makes them absolute).
Text left open at the end (the decode stopped before a closing timestamp) ends with the
piece; a segment max_completion_tokens cut keeps its closing timestamp. Where words are timed,
a segment runs from its first word's start to its last word's end. Word times come from the
engine's alignment (DecodeSummary.token_times)."""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import numpy as np

from asrserve.entrypoints.pieces import PieceResult, written_in
from asrserve.entrypoints.words import split_words
from asrserve.model.tokenizer import WhisperTokenizer

MIN_DURATION_S = 0.02  # one timestamp step: every segment and word lasts at least this
SENTENCE_END = ".。!！?？"
# A word that ends a clause is followed by a pause as often as one that ends a sentence.
CLAUSE_END = ",;:，、；："


@dataclass
class Word:
    word: str
    start: float
    end: float


@dataclass
class Segment:
    id: int
    seek: int  # the piece's start in 10 ms mel frames, as openai/whisper reports it
    start: float
    end: float
    text: str
    tokens: list[int]
    temperature: float
    avg_logprob: float
    compression_ratio: float
    no_speech_prob: float
    words: list[Word] = field(default_factory=list)
    text_token_start: int = 0  # index of its first text token among the piece's text tokens
    left_open: bool = False  # no closing timestamp, or cut by max_completion_tokens: its last word ends it


def build_segments(
    tokenizer: WhisperTokenizer, pieces: list[PieceResult], language: str | None, words: bool = False,
    task: str = "transcribe",
) -> list[Segment]:
    """Each piece's words are split by the language its text is written in (pieces.written_in):
    a Japanese piece after an English one has no spaces between its words."""
    segments: list[Segment] = []
    for piece in pieces:
        if piece.is_silence:
            continue
        piece_segments = _piece_segments(tokenizer, piece, first_id=len(segments))
        if words and piece.summary is not None and piece.summary.token_times:
            _add_words(tokenizer, piece, piece_segments, written_in(piece.language or language, task))
        segments.extend(piece_segments)
    return segments


def _piece_segments(tokenizer: WhisperTokenizer, piece: PieceResult, first_id: int) -> list[Segment]:
    """Splits the piece's tokens at its timestamp pairs."""
    eot = tokenizer.special.eot
    end_of_piece = piece.duration_s
    spans: list[tuple[float, float | None, list[int]]] = []  # (start, end or None if left open, tokens)
    opening: float | None = None
    tokens: list[int] = []
    last_time = 0.0
    for token in piece.token_ids:
        if tokenizer.is_timestamp(token):
            time = min(tokenizer.timestamp_seconds(token), end_of_piece)
            tokens.append(token)
            if opening is None:
                opening = time
            else:
                spans.append((opening, time, tokens))
                opening, tokens = None, []
            last_time = time
        elif token < eot:
            if opening is None:  # text without an opening timestamp starts where the last ended
                opening = last_time
            tokens.append(token)
    if opening is not None:
        spans.append((opening, None, tokens))

    summary = piece.summary
    segments = []
    text_token_start = 0
    for start, end, span_tokens in spans:
        text_tokens = [t for t in span_tokens if t < eot]
        text = tokenizer.decode(text_tokens)
        if not text.strip():
            text_token_start += len(text_tokens)
            continue
        left_open = end is None or (piece.cut_in_segment and span_tokens is spans[-1][2])
        start, end = _ordered(start, end_of_piece if end is None else end, end_of_piece)
        segments.append(
            Segment(
                id=first_id + len(segments),
                seek=math.floor(piece.offset_s * 100 + 1e-6),  # never after the piece's start
                start=piece.offset_s + start,
                end=piece.offset_s + end,
                text=text,
                tokens=span_tokens,
                temperature=summary.temperature if summary else 0.0,
                avg_logprob=summary.avg_logprob if summary else 0.0,
                compression_ratio=summary.compression_ratio if summary else 0.0,
                no_speech_prob=(summary.no_speech_prob or 0.0) if summary else 0.0,
                text_token_start=text_token_start,
                left_open=left_open,
            )
        )
        text_token_start += len(text_tokens)
    return segments


def _ordered(start: float, end: float, limit: float) -> tuple[float, float]:
    """start < end inside [0, limit]: a segment the model closed at its opening time, or placed
    past the end of the audio, still gets a visible span."""
    end = min(max(end, start + MIN_DURATION_S), limit)
    start = max(0.0, min(start, end - MIN_DURATION_S))
    return start, end


def _add_words(tokenizer: WhisperTokenizer, piece: PieceResult, segments: list[Segment], language: str | None) -> None:
    times = piece.summary.token_times
    eot = tokenizer.special.eot
    text_tokens = [t for t in piece.token_ids if t < eot]
    if len(times) != len(text_tokens) + 1:  # truncated by max_completion_tokens: end at the last kept token
        times = times[: len(text_tokens)] + [times[min(len(text_tokens), len(times) - 1)]]
    durations = []
    for segment in segments:
        segment_tokens = [t for t in segment.tokens if t < eot]
        index = segment.text_token_start
        for text, count in split_words(tokenizer, segment_tokens, language):
            start, end = times[index], times[index + count]
            index += count
            if text.strip():
                segment.words.append(Word(text.strip(), piece.offset_s + start, piece.offset_s + end))
                durations.append(end - start)
    _tidy_words(segments, durations)
    # With word times a segment spans its words, as openai/whisper's transcribe has it: Whisper's
    # own timestamps run over pauses (a sentence before 10 s of quiet "ended" at 16.2 s, its last
    # word at 5.9 s), and text left open or cut by a token limit has none at its end.
    for segment in segments:
        if segment.words:
            segment.start, segment.end = segment.words[0].start, segment.words[-1].end


def _tidy_words(segments: list[Segment], durations: list[float]) -> None:
    """Caps words that swallowed a pause (longer than twice the median word, at most 1.4 s:
    the alignment stretches a word at a sentence's or a clause's end, or after a pause: "be,"
    said 13.9-14.6 s before a 0.8 s pause was cut from its start to 15.0-15.5, in the pause),
    then keeps every word
    inside its segment, in order, with a positive length. A segment's first word that ends
    inside its segment is cut from its start: the pause is before it ("Mr." after 8 s of quiet
    was timed 0.0-0.5 s, "Quilter" 9.0 s). One that runs past its segment's end swallowed the
    pause after it ("Yes." and 4 s of silence: cut from its start, then held inside its
    segment, it came to 20 ms at the segment's end)."""
    positive = [d for d in durations if d > 0]
    max_duration = 2 * min(0.7, float(np.median(positive))) if positive else 1.4
    for segment in segments:
        words = segment.words
        for i, word in enumerate(words):
            if word.end - word.start > max_duration:
                pause_before = i == 0 and word.end <= segment.end
                if not pause_before and (word.word[-1] in SENTENCE_END + CLAUSE_END or i == len(words) - 1):
                    word.end = word.start + max_duration
                else:
                    word.start = word.end - max_duration
        # Each word keeps room for those after it: words piled up at the segment's end used to
        # start before the previous one ended.
        step = min(MIN_DURATION_S, (segment.end - segment.start) / max(1, len(words)))
        previous_end = segment.start
        for i, word in enumerate(words):
            latest_end = segment.end - (len(words) - 1 - i) * step
            word.start = min(max(word.start, previous_end), latest_end - step)
            word.end = min(max(word.end, word.start + step), latest_end)
            previous_end = word.end
