"""Decoding a live utterance: one engine request per decode, and the rule that decides which of
an interim decode's words are stable enough to send.

Whisper is not a streaming model, so a growing utterance is decoded again every so often
(interim decodes) and once more when it is committed (the final decode). Text sent to a client
cannot be taken back, so every decode of an utterance continues the tokens already sent: they
are its forced prefix (openai/whisper's `prefix`). A word becomes stable, and is sent, when two
interim decodes in a row agree on it and on the start of a word after it (local agreement, as
whisper_streaming does) and on the word after it beginning at least STABLE_MARGIN_S before
the end of the audio decoded (a word at the very edge is often misheard, and two decodes of
nearly the same audio can agree on it), and when the latest decode chose none of its tokens
with a log-probability below MIN_STABLE_LOGPROB. The final decode only adds to what was sent;
the deltas of an item joined are exactly its completed transcript."""

from __future__ import annotations

import asyncio
import itertools
import uuid
from dataclasses import dataclass, replace

import numpy as np

from asrserve.engine.async_client import AsyncEngineClient
from asrserve.engine.engine_process import EngineRequest
from asrserve.engine.request import NO_SPEECH_THRESHOLD, UNSURE_LANGUAGE_PROBABILITY, SamplingParams
from asrserve.errors import InvalidRequestError
from asrserve.model.languages import NO_SPACE_LANGUAGES
from asrserve.model.tokenizer import WhisperTokenizer

STABLE_MARGIN_S = 0.5
# A word is not sent while the latest decode chose any of its tokens with less than this
# log-probability (benchmarks/live_stability.py: without it, tiny.en sent early misreadings
# that both decodes agreed on, and live WER was 6 points above one decode of the utterance).
MIN_STABLE_LOGPROB = -1.0
# OpenAI's `delay` (how long text waits before it is sent) as that floor, from the measured
# trade (docs/benchmarks.md, "Which words go out while the person speaks": floors of -2.0,
# -1.5, -1.0, -0.5 sent 72, 57, 45, 21 % of words during speech at 16.3, 13.7, 12.4, 11.8 %
# WER); "xhigh" sends nothing before the turn's final decode. Not given: "medium".
STABLE_LOGPROB_BY_DELAY = {"minimal": -2.0, "low": -1.5, "medium": MIN_STABLE_LOGPROB, "high": -0.5, "xhigh": None}
SESSION_ENDED = "the live session ended"  # why its decodes were cancelled, when it is that
_ids = itertools.count()
_prefix = uuid.uuid4().hex[:8]


@dataclass
class LiveDecode:
    token_ids: list[int]  # text tokens after the prefix
    logprobs: list[float]
    language: str | None
    no_speech: bool  # judged silence (only when nothing had been sent)
    token_times: list[float] | None = None  # interim decodes: when each token starts (s, from the audio's start)
    language_sure: bool = True  # given, or detected at UNSURE_LANGUAGE_PROBABILITY or more


def interim_params(languages: tuple[str, ...] = (), language_if_unsure: str | None = None) -> SamplingParams:
    """Greedy, once: an interim decode is replaced a moment later, so it must be quick. Word
    timestamps (from the cross-attention the decode computes anyway) say which words lie well
    inside the audio decoded so far. languages: those a detection may pick (empty: any);
    language_if_unsure: the session's language so far (RealtimeSession.heard_language)."""
    return SamplingParams(temperature=0.0, no_speech_threshold=NO_SPEECH_THRESHOLD, word_timestamps=True,
                          languages=languages, language_if_unsure=language_if_unsure)


def session_language(heard: str | None, languages: tuple[str, ...]) -> str | None:
    """Where a live turn's language is detected, the one taken where the detection is unsure:
    the session's so far (`heard`: its last final's, detected with certainty or given), within
    its languages[]. A short turn ("Ja.", "Merci beaucoup.", "Grazie.") is detected unsure,
    mostly as English, and was written in it ("Yeah.", "Thank you.")."""
    return heard if heard and (not languages or heard in languages) else None


def final_params(has_prefix: bool, languages: tuple[str, ...] = (), language_if_unsure: str | None = None
                 ) -> SamplingParams:
    """OpenAI's transcription defaults, as a file upload gets them (temperature fallback with
    best_of 5, silence judgement): a live transcript is as accurate as the same audio sent as a
    file. Once words have been sent they stand: no silence judgement then."""
    params = SamplingParams.transcription(0.0, languages=languages, language_if_unsure=language_if_unsure)
    if has_prefix:
        return replace(params, no_speech_threshold=None)
    return params


class DecodeCollector:
    """Gathers one decode's engine outputs into a LiveDecode (a fallback restart voids what
    came before it)."""

    def __init__(self, language: str | None):
        self.language = language
        self.token_ids: list[int] = []
        self.logprobs: list[float] = []
        self.summary = None
        self.language_sure = True

    def add(self, output) -> None:
        if output.finish_reason == "error":
            error = RuntimeError if output.bug else InvalidRequestError
            raise error(output.error or "the engine refused the request")
        if output.restarted:
            self.token_ids.clear()
            self.logprobs.clear()
        self.token_ids.extend(output.new_token_ids)
        self.logprobs.extend(output.new_logprobs)
        self.language = output.language or self.language
        if output.language_probability is not None:
            self.language_sure = output.language_probability >= UNSURE_LANGUAGE_PROBABILITY
        self.summary = output.summary if output.finished else self.summary

    def result(self, tokenizer: WhisperTokenizer) -> LiveDecode:
        eot = tokenizer.special.eot
        kept = [(token, logprob) for token, logprob in zip(self.token_ids, self.logprobs) if token < eot]
        summary = self.summary
        times = summary.token_times if summary is not None and summary.token_times else None
        return LiveDecode(
            [token for token, _ in kept], [logprob for _, logprob in kept], self.language,
            summary is not None and summary.no_speech, times[: len(kept)] if times else None, self.language_sure,
        )


async def decode(
    engine: AsyncEngineClient, tokenizer: WhisperTokenizer, audio: np.ndarray, language: str | None,
    prompt: str | None, prefix: list[int], params: SamplingParams, final: bool = False,
    previous: list[int] | None = None, prompt_head: str | None = None,
) -> LiveDecode:
    """One engine request, served ahead of file work (a final decode also ahead of interims);
    cancelling this aborts it. previous: the tokens of the latest interim decode of this audio
    (so far), whose words after `prefix` the engine checks several at a time (draft_after).
    prompt_head: the session's keywords, read in front of the prompt (EngineRequest)."""
    request_id = f"rt-{_prefix}-{next(_ids)}"
    request = EngineRequest(request_id, audio, language, "transcribe", params, prompt, list(prefix), interactive=True,
                            urgent=final, draft=draft_after(previous, prefix), prompt_head=prompt_head)
    stream = engine.add([request])[0]
    collected = DecodeCollector(language)
    try:
        async for output in stream:
            collected.add(output)
    except asyncio.CancelledError as cancelled:
        # Counted as stopped early where the session ended with it in flight; not where a
        # later decode supersedes it, which is routine.
        engine.abort([request_id], counted=SESSION_ENDED in cancelled.args)
        # The error's traceback keeps this frame, in a cycle with its task that only the cycle
        # collector frees (after closed sessions, ~30 audio slices of up to 1.9 MB each were
        # still held 12 s later): the audio goes now.
        del audio, request
        raise
    return collected.result(tokenizer)


def draft_after(previous: list[int] | None, sent: list[int]) -> list[int] | None:
    """What the latest interim decode (`previous`, its tokens) read after the tokens sent:
    most of the next decode's tokens (the final's, or the next interim's, which reads the same
    audio and a little more), which the engine then checks several a step rather than
    decoding them one a step. None when it does not continue what was sent."""
    if not previous or previous[: len(sent)] != sent:
        return None
    return previous[len(sent):] or None


def logprob_entry(tokenizer: WhisperTokenizer, token: int, logprob: float) -> dict:
    """One token's entry in a delta's or completed's `logprobs` (OpenAI's shape)."""
    return {"token": tokenizer.decode([token]), "bytes": list(tokenizer.token_bytes(token)), "logprob": logprob}


class WordBoundaries:
    """Which tokens begin a word: those whose text starts with a space. In languages written
    without spaces every whole character is a unit (a token that ends inside a character's
    UTF-8 bytes is not)."""

    def __init__(self, tokenizer: WhisperTokenizer):
        self.tokenizer = tokenizer
        self._starts: dict[int, bool] = {}

    def starts_word(self, token: int, language: str | None) -> bool:
        if language in NO_SPACE_LANGUAGES:
            return "\ufffd" not in self.tokenizer.decode([token])
        if token not in self._starts:
            self._starts[token] = self.tokenizer.decode([token])[:1].isspace()
        return self._starts[token]

    def stable_length(self, previous: list[int], current: list[int], start: int, language: str | None,
                      times: list[float] | None = None, latest: float = float("inf"),
                      logprobs: list[float] | None = None, min_logprob: float | None = None) -> int:
        """How many leading tokens of `current` are stable: the longest common prefix of two
        successive decodes (full token lists, prefix included), cut back to the start of a
        word, never past the last one (the next audio may still change it) nor past a word
        that begins after `latest` seconds (`times`: when each token of `current` begins): a
        word heard at the very end of the audio so far is often misheard, and agreeing twice
        on it does not make it right. Never less than `start` (the prefix already sent).
        With `min_logprob`, agreement also ends at the first token `current` chose with a
        log-probability below it (`logprobs`: one per token of `current`): a guess made twice
        is still a guess."""
        agreed = start
        for a, b in zip(previous[start:], current[start:]):
            if a != b or (min_logprob is not None and logprobs[agreed] < min_logprob):
                break
            agreed += 1
        for end in range(agreed - 1, start, -1):  # the last word start after the prefix's first token
            if self.starts_word(current[end], language) and (times is None or times[end] <= latest):
                return end
        return start
