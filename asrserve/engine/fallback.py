"""Judging a finished decode of one piece, as openai/whisper's transcribe() does: is it too
repetitive or too unlikely (retry at the next temperature), is it silence (drop its text), and
which attempt to keep when every temperature failed."""

from __future__ import annotations

import zlib
from collections.abc import Callable

from asrserve.engine.request import Attempt, DecodeSummary, Request, SamplingParams


def compression_ratio(text: str) -> float:
    """Bytes of the text over bytes of its zlib compression: looping text compresses well."""
    data = text.encode("utf-8")
    if not data:
        return 0.0
    return len(data) / len(zlib.compress(data))


def tail_repeats(token_ids: list[int], timestamp_begin: int, min_repeats: int = 3, max_unit: int = 32) -> bool:
    """Whether the text tokens end in one unit of up to max_unit tokens said min_repeats times
    in a row ("the the the", or a sentence over and over): Whisper's decoding loop. Timestamp
    tokens are left out, as they keep rising while the text repeats."""
    window = max_unit * min_repeats
    text: list[int] = []
    for token in reversed(token_ids):
        if token < timestamp_begin:
            text.append(token)
            if len(text) == window:
                break
    text.reverse()
    for unit in range(1, min(max_unit, len(text) // min_repeats) + 1):
        tail = text[-unit:]
        if all(text[-(k + 1) * unit: len(text) - k * unit] == tail for k in range(1, min_repeats)):
            return True
    return False


def can_no_longer_pass(token_ids: list[int], text: Callable[[list[int]], str], threshold: float | None,
                       timestamp_begin: int) -> bool:
    """A sample that is already too repetitive to pass the compression-ratio check and is still
    repeating itself: ended now, it fails as it would after running on to its token limit.
    text decodes the tokens (only called once the tail repeats)."""
    if threshold is None or not tail_repeats(token_ids, timestamp_begin):
        return False
    return compression_ratio(text(token_ids)) > threshold


LOOP_CHECK_EVERY = 8  # tokens between checks for a looping sample


def is_looping(sequence: Request, tokenizer) -> bool:
    """A sample that can no longer pass, to be ended early; only where a fallback can follow (a
    decode whose text is kept in any case runs on). Every 8th token: a loop runs on for many
    more, and the check is Python on each sequence."""
    if len(sequence.output_token_ids) % LOOP_CHECK_EVERY or not (sequence.primary or sequence).group.has_fallback:
        return False
    return can_no_longer_pass(
        sequence.output_token_ids, tokenizer.decode, sequence.sampling_params.compression_ratio_threshold,
        tokenizer.special.timestamp_begin,
    )


def summarize(
    token_ids: list[int], logprobs: list[float], text: str, temperature: float, no_speech_prob: float | None, eot: int
) -> DecodeSummary:
    """avg_logprob as openai/whisper computes it: every sampled token's logprob (timestamps and
    <|endoftext|> included) over the number of tokens before <|endoftext|>, plus one."""
    num_tokens = len(token_ids) - (1 if token_ids and token_ids[-1] == eot else 0)
    return DecodeSummary(
        temperature=temperature,
        avg_logprob=sum(logprobs) / (num_tokens + 1),
        compression_ratio=compression_ratio(text),
        no_speech_prob=no_speech_prob,
        no_speech=False,
        num_attempts=1,
    )


def _unlikely(summary: DecodeSummary, params: SamplingParams) -> bool:
    return params.logprob_threshold is not None and summary.avg_logprob < params.logprob_threshold


def is_silence(summary: DecodeSummary, params: SamplingParams) -> bool:
    """Whisper thinks nothing was said, and what it wrote is unlikely: drop the text."""
    return (
        params.no_speech_threshold is not None
        and summary.no_speech_prob is not None
        and summary.no_speech_prob > params.no_speech_threshold
        and _unlikely(summary, params)
    )


def needs_fallback(summary: DecodeSummary, params: SamplingParams) -> bool:
    threshold = params.compression_ratio_threshold
    too_repetitive = threshold is not None and summary.compression_ratio > threshold
    # Silence is not retried: another temperature would only invent other words.
    return (too_repetitive or _unlikely(summary, params)) and not is_silence(summary, params)


def pick_attempt(attempts: list[Attempt], params: SamplingParams) -> Attempt:
    """The attempt to keep once every temperature has been tried: the likeliest of those that
    are not too repetitive (all of them, if every one is)."""
    threshold = params.compression_ratio_threshold
    candidates = [a for a in attempts if threshold is None or a.summary.compression_ratio <= threshold] or attempts
    return max(candidates, key=lambda attempt: attempt.summary.avg_logprob)
