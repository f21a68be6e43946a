"""Seek continuation: when Whisper leaves a piece unfinished, the rest of the piece is decoded
again, from where its last good segment ended, as a new engine request.

openai/whisper decodes long audio one 30 s window after another and starts each window at the
last timestamp of the one before (its "seek"), so speech a window skipped is read again by the
next. asrserve cuts the audio into pieces and decodes them side by side, so nothing reads a
piece a second time unless we ask: a piece whose decode stopped early, ran out of tokens in
the middle of a segment, or wrote an implausibly long segment for its few words (tiny.en's
"24 s segment of five words", which skips the forty words under it) gets a continuation
request for the rest of it, batched with everything else. The piece's own tokens are cut at
the seek point, so text is never written twice, and the continuation's times are offset by
where it starts, so segment and word times stay absolute.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import Callable

import numpy as np

from asrserve.audio.chunking import ChunkingStrategy, first_sound
from asrserve.config import SAMPLE_RATE
from asrserve.engine.request import SamplingParams
from asrserve.entrypoints.pieces import PieceResult
from asrserve.model.tokenizer import WhisperTokenizer

MIN_REMAINDER_S = 1.0  # less audio than this after the seek point holds no missed sentence
MIN_PROGRESS_S = 1.0  # a continuation must start at least this far into its piece
# A decode that ended (<|endoftext|>) at least this long before its piece did may have stopped
# early; it is continued if the rest of the piece has sound in it.
EARLY_STOP_S = 2.0
# A segment at least this long with fewer text tokens per second than this skipped speech
# (people say 2-4 tokens a second; a pause splits segments rather than stretching one).
IMPLAUSIBLE_SEGMENT_S = 6.0
IMPLAUSIBLE_TOKENS_PER_S = 1.0
SECONDS_PER_TOKEN = 0.35  # a generous time for one spoken token, for segments cut short
MAX_CONTINUATIONS = 8  # per piece: one that keeps stopping early cannot loop for ever
# A continuation whose audio opens on a pause this long starts this long before the sound
# after it instead (the padding server VAD keeps before speech).
PAUSE_SKIPPED_S = 2.0
PAUSE_KEPT_S = 0.3
# Decodes that ended before their text did: the token limit ran out, or a loop was cut short
# (fallback.is_looping; the speaker may really have said it three times). The rest is read again.
CUT_SHORT = ("length", "repetition")
# Previous text is not carried across a decode that needed a high temperature (openai/whisper
# resets its prompt there too: such text is more likely wrong than useful).
MAX_PROMPT_TEMPERATURE = 0.5
# A decode that stopped early (or wrote a long first segment) over less speech than this
# (Silero's) before its seek point, with speech after it, wrote its text where no one speaks:
# music or noise before the speech took Whisper's first timestamp, the sentence was timed over
# it, and a continuation from its end read the sentence again.
MIN_SPEECH_UNDER_TEXT_S = 1.0

# Speech regions ([start, end) samples) of a piece's audio; None where they cannot be known.
SpeechFinder = Callable[[np.ndarray], "list[tuple[int, int]] | None"]


@dataclass
class _Segment:
    start_s: float
    end_s: float
    num_text: int
    first_index: int  # of its opening timestamp (or first text token) in the piece's tokens
    end_index: int  # one past its closing timestamp


@dataclass
class Continuation:
    """The rest of a piece: where it starts, its audio, and what it is decoded with."""

    seek_s: float  # from the start of the parent piece
    reason: str  # "early_stop", "length", "repetition", "implausible_segment", "implausible_open" or
    # "text_before_speech": for logs
    prompt: str | None  # the user's prompt and the parent's text, as previous text
    samples: np.ndarray  # the parent's audio from seek_s on
    result: PieceResult  # where its outputs go: offset and language follow the parent's


def plan_continuation(
    tokenizer: WhisperTokenizer,
    piece: PieceResult,
    samples: np.ndarray,
    depth: int,
    user_prompt: str | None,
    language: str | None = None,
    *,
    timestamps: bool,
    find_speech: SpeechFinder | None = None,
    text_shown: bool = False,
) -> Continuation | None:
    """Decides whether the finished `piece` (its audio: `samples`) needs a continuation, and if
    so cuts its tokens at the seek point. depth: continuations already made for this piece;
    language: the job's, for a piece that has none of its own; timestamps: whether the piece
    decoded with them. Without them there is nothing to seek by: a stray timestamp token after
    <|notimestamps|> (random weights write them) once sent a json request past its 224 tokens.
    find_speech (speech_finder): where a decode stopped early, whether speech (not any sound:
    music and noise made every stop early, each continuation another "Thank you.") follows;
    without it, sound by energy. text_shown: the piece's settled text has been streamed, and
    is kept whatever follows."""
    if depth >= MAX_CONTINUATIONS or piece.is_silence or piece.finish_reason not in ("stop", *CUT_SHORT):
        return None
    eot = tokenizer.special.eot
    if not timestamps:
        return None
    segments, open_text = _segments(tokenizer, piece.token_ids, piece.duration_s)
    found = _seek_point(piece, segments, open_text)
    if found is None:
        return None
    seek_s, keep, reason, closing_time = found
    if seek_s < MIN_PROGRESS_S or piece.duration_s - seek_s < MIN_REMAINDER_S:
        return None
    seek_sample = round(seek_s * SAMPLE_RATE)
    heard = ("early_stop", "implausible_open", "implausible_segment")  # the reasons that suppose speech after
    speech = find_speech(samples) if find_speech is not None and reason in heard else None

    def heard_after(sample: int) -> int | None:  # samples from `sample` to the next speech (or sound)
        return first_sound(samples[sample:], samples) if speech is None else _speech_after(speech, sample)

    sound = heard_after(seek_sample)
    # (A long segment of few words over music or noise, with no speech after: as it is. By
    # energy, sound is any noise, and a long segment is continued regardless.)
    if sound is None and (reason in ("early_stop", "implausible_open") or speech is not None):
        return None
    if reason == "implausible_open":  # sound after where its words would plausibly end, not theirs
        if heard_after(round(_plausible_end(open_text) * SAMPLE_RATE)) is None:
            return None  # a last sentence, then silence: kept as it is
    start_sample = _past_the_pause(seek_sample, sound)
    speech_from = speech[0][0] - round(PAUSE_KEPT_S * SAMPLE_RATE) if speech else 0
    if (reason in ("early_stop", "implausible_segment") and not text_shown
            and speech_from >= MIN_PROGRESS_S * SAMPLE_RATE and _speech_s(speech, seek_sample) < MIN_SPEECH_UNDER_TEXT_S):
        # Its text lies where no one speaks (or, a long first segment, where its words would
        # be said): dropped, and the piece read again from its speech.
        keep, seek_sample, start_sample, reason = 0, speech_from, speech_from, "text_before_speech"
        seek_s, closing_time = seek_sample / SAMPLE_RATE, None
    del piece.token_ids[keep:]
    del piece.logprobs[keep:]
    if closing_time is not None:  # an implausible first segment keeps its text, ending where we seek
        closing = tokenizer.timestamp_token(closing_time)
        if tokenizer.is_timestamp(piece.token_ids[keep - 1]):
            piece.token_ids[keep - 1] = closing
        else:  # text left open: closed there
            piece.token_ids.append(closing)
            piece.logprobs.append(0.0)
    piece.duration_s = seek_s
    temperature = piece.summary.temperature if piece.summary else 0.0
    text = tokenizer.decode([token for token in piece.token_ids if token < eot]).strip()
    # Not text that looped either: conditioned on three copies of a sentence, the rest stopped
    # after its first words.
    carried = text and temperature <= MAX_PROMPT_TEMPERATURE and reason != "repetition"
    prompt = text if carried else None
    if user_prompt and user_prompt.strip():  # as openai/whisper: the user's prompt, then the text before
        prompt = f"{user_prompt.strip()} {prompt}" if prompt else user_prompt  # (its last 223 tokens are read)
    rest = samples[start_sample:]
    result = PieceResult(
        piece.offset_s + start_sample / SAMPLE_RATE, len(rest) / SAMPLE_RATE, language=piece.language or language,
        is_continuation=True,
    )
    return Continuation(seek_s, reason, prompt, rest, result)


def continuation_language(requested: str | None, plan: Continuation, params: SamplingParams
                          ) -> tuple[str | None, SamplingParams]:
    """A continuation's language and params: the request's language, else detected again (the
    rest of an English piece, in Spanish, came out in English), the piece's where that is unsure."""
    if requested is not None or plan.result.language is None:
        return requested, params
    return None, replace(params, language_if_unsure=plan.result.language)


def speech_finder(strategy: ChunkingStrategy) -> SpeechFinder | None:
    """Silero's speech regions, at the strategy's threshold, for a voice-activity strategy (None for
    "energy"); a finder that gives None where Silero cannot be loaded (then energy is used)."""
    if strategy.type == "energy":
        return None

    def find(samples: np.ndarray) -> list[tuple[int, int]] | None:
        from asrserve.audio import vad

        try:
            threshold = vad.DEFAULT_THRESHOLD if strategy.threshold is None else strategy.threshold
            return vad.speech_regions(samples, threshold)
        except ImportError:  # vad.VADUnavailableError
            return None

    return find


def _speech_after(regions: list[tuple[int, int]], sample: int) -> int | None:
    """Samples from `sample` to the first speech at or after it (0 inside speech), or None."""
    return next((max(0, start - sample) for start, end in regions if end > sample), None)


def _speech_s(regions: list[tuple[int, int]], end_sample: int) -> float:
    """Seconds of speech before `end_sample`."""
    return sum(max(0, min(end, end_sample) - start) for start, end in regions) / SAMPLE_RATE


def _past_the_pause(seek_sample: int, sound: int | None) -> int:
    """Where the continuation starts: the seek point, or, when a long pause follows it (the first
    sound `sound` samples later), just before that sound. Whisper places a window's first timestamp
    in its first second: a window opening on 12 s of pause timed the next sentence from its start."""
    if sound is None or sound < PAUSE_SKIPPED_S * SAMPLE_RATE:
        return seek_sample
    return seek_sample + sound - round(PAUSE_KEPT_S * SAMPLE_RATE)


def settled_length(tokenizer: WhisperTokenizer, token_ids: list[int]) -> int:
    """How many of a decode's tokens (so far) no continuation can take back: all of them
    without timestamps; else those up to the last closed segment before the first implausible
    one (text still open may be read again, and an implausible segment may be)."""
    if not any(tokenizer.is_timestamp(token) for token in token_ids):
        return len(token_ids)
    segments, _ = _segments(tokenizer, token_ids)
    settled = 0
    for segment in segments:
        if _implausible(segment):
            break
        settled = segment.end_index
    return settled


def _plausible_end(segment: _Segment) -> float:
    """Where a segment's words would end, said at a generous pace (on the 0.02 s timestamp grid)."""
    return round((segment.start_s + 1.0 + segment.num_text * SECONDS_PER_TOKEN) / 0.02) * 0.02


def _implausible(segment: _Segment) -> bool:
    duration = segment.end_s - segment.start_s
    return duration >= IMPLAUSIBLE_SEGMENT_S and segment.num_text / duration < IMPLAUSIBLE_TOKENS_PER_S


def _segments(tokenizer: WhisperTokenizer, token_ids: list[int], duration_s: float = 30.0
              ) -> tuple[list[_Segment], _Segment | None]:
    """The closed segments (text between two timestamps), and the text left open at the end as
    a segment that runs to `duration_s` (its end_index one past its last text token; None if
    the tokens end with a closed segment)."""
    eot = tokenizer.special.eot
    segments: list[_Segment] = []
    opening: float | None = None
    first_index = text_end = 0
    num_text = 0
    last_end = 0.0
    for index, token in enumerate(token_ids):
        if tokenizer.is_timestamp(token):
            time = tokenizer.timestamp_seconds(token)
            if opening is None:
                opening, first_index, num_text = time, index, 0
            else:
                segments.append(_Segment(opening, time, num_text, first_index, index + 1))
                opening, last_end = None, time
        elif token < eot:
            if opening is None:  # text with no opening timestamp starts where the last segment ended
                opening, first_index, num_text = last_end, index, 0
            num_text, text_end = num_text + 1, index + 1
    if opening is None:
        return segments, None
    return segments, _Segment(opening, max(duration_s, opening), num_text, first_index, max(text_end, first_index))


def _seek_point(
    piece: PieceResult, segments: list[_Segment], open_text: _Segment | None
) -> tuple[float, int, str, float | None] | None:
    """(seek seconds, tokens to keep, reason, new closing time of the last kept segment or None)."""
    # Text left open by <|endoftext|> runs to the piece's end: implausible too where it is a
    # sentence, then seconds of speech under no text (a piece's language changing there: the
    # speech skipped). (A lone timestamp has no words to keep.)
    left_open = [open_text] if open_text is not None and open_text.num_text and piece.finish_reason == "stop" else []
    for segment in (*segments, *left_open):
        if _implausible(segment):
            reason = "implausible_open" if segment is open_text else "implausible_segment"
            if segment.start_s >= MIN_PROGRESS_S:  # decode again from where it begins
                return segment.start_s, segment.first_index, reason, None
            # It opens the piece: decoding from the same place would read the same window, so
            # keep its words, give them a plausible span and decode the rest after it.
            seek_s = _plausible_end(segment)
            return seek_s, segment.end_index, reason, seek_s
    if not segments:
        return None
    last_end, keep = segments[-1].end_s, segments[-1].end_index
    # A loop cut short is read again after its last segment (plan_continuation checks what
    # remains); so is text left open when the tokens ran out, cut mid-sentence. Text left open
    # by <|endoftext|> is the piece's last sentence running to its end (a piece ends at a cut,
    # not inside speech that goes on, as openai/whisper's windows do): kept. A lone opened
    # timestamp is no text: `... you.<27.04><28.56><|endoftext|>` stopped at 27.04.
    if piece.finish_reason == "repetition" or (piece.finish_reason == "length" and open_text is not None):
        return last_end, keep, piece.finish_reason, None
    stopped = open_text is None or not open_text.num_text
    if stopped and piece.finish_reason == "stop" and piece.duration_s - last_end >= EARLY_STOP_S:
        return last_end, keep, "early_stop", None
    return None


MAX_REPEATED_WORDS = 40  # the longest overlap looked for between a piece and its continuation
MIN_REPEATED_WORDS = 2  # one repeated word may well have been said twice
SHORT_SEGMENT_WORDS = 3  # a last segment this short may be re-read whole


def drop_repeated_words(tokenizer: WhisperTokenizer, pieces: list[PieceResult]) -> None:
    """A continuation starts at its parent's last timestamp, which Whisper may place before the
    parent's last words end: the continuation then writes them again. Drops the words a
    continuation opens with that its parent's text ends with (at least two in a row), and
    fewer than the parent's last segment holds, unless it is a few words: a timestamp early by
    a moment re-reads the end of that segment, not a whole sentence. (A sentence said again, as
    a loop's continuation follows the copies its parent kept, was dropped whole, and the copies
    after it with it.)"""
    eot = tokenizer.special.eot
    for previous, piece in zip(pieces, pieces[1:]):
        if not piece.is_continuation or previous.is_silence or piece.is_silence:
            continue
        segments, _ = _segments(tokenizer, previous.token_ids)
        limit = MAX_REPEATED_WORDS
        if segments:  # (a segment of a few words, "Thank you.", may be re-read whole)
            last = len(_normalized_words(tokenizer.decode(previous.token_ids[segments[-1].first_index :])))
            limit = min(limit, last - 1 if last > SHORT_SEGMENT_WORDS else last)
        before = _normalized_words(tokenizer.decode(previous.token_ids))[-limit:] if limit > 0 else []
        text_tokens = [token for token in piece.token_ids if token < eot]
        after = _normalized_words(tokenizer.decode(text_tokens))
        overlap = next(
            (k for k in range(min(len(before), len(after)), MIN_REPEATED_WORDS - 1, -1) if before[-k:] == after[:k]), 0
        )
        if not overlap:
            continue
        # The fewest text tokens that hold those words and end where a new word starts.
        for count in range(1, len(text_tokens) + 1):
            words = _normalized_words(tokenizer.decode(text_tokens[:count]))
            next_starts_word = count == len(text_tokens) or tokenizer.decode(text_tokens[count : count + 1])[:1] in " "
            if len(words) >= overlap and words[:overlap] == after[:overlap] and next_starts_word:
                _drop_text_tokens(piece, count, eot)
                break


def _drop_text_tokens(piece: PieceResult, count: int, eot: int) -> None:
    """Removes the piece's first `count` text tokens (its timestamps stay)."""
    kept_tokens, kept_logprobs, dropped = [], [], 0
    for token, logprob in zip(piece.token_ids, piece.logprobs):
        if token < eot and dropped < count:
            dropped += 1
            continue
        kept_tokens.append(token)
        kept_logprobs.append(logprob)
    piece.token_ids[:] = kept_tokens
    piece.logprobs[:] = kept_logprobs
    if piece.summary is not None and piece.summary.token_times:
        piece.summary.token_times = piece.summary.token_times[count:]


def _normalized_words(text: str) -> list[str]:
    return re.findall(r"\w+", text.lower())
