"""One HTTP transcription: its audio pieces run as engine requests side by side, and their
text comes back in order, as deltas, joined the way offline transcription joins it. A piece
Whisper left unfinished is continued by a new request for its rest (entrypoints.continuation)."""

from __future__ import annotations

import asyncio
import functools
import itertools
import math
import time
import uuid
from collections.abc import AsyncIterator, Callable
from dataclasses import replace

import numpy as np

from asrserve.audio.chunking import AudioPiece, ChunkingStrategy
from asrserve.config import SAMPLE_RATE
from asrserve.engine.async_client import AsyncEngineClient, RequestStream
from asrserve.engine.engine_process import EngineRequest
from asrserve.engine.request import SamplingParams
from asrserve.entrypoints.continuation import (
    continuation_language, drop_repeated_words, plan_continuation, settled_length, speech_finder,
)
from asrserve.entrypoints.pieces import (
    PieceResult, cap_text_tokens, joiner, long_form_params, spoken_language, transcript_text, written_in,
)
from asrserve.entrypoints.preprocess import PreparedAudio
from asrserve.errors import InvalidRequestError
from asrserve.model.tokenizer import WhisperTokenizer


class IncrementalText:
    """Text of one piece as its tokens arrive. Each delta is final: text ending in a partial
    UTF-8 character (byte-level BPE splits them across tokens) waits for the next token, and
    whitespace at either end is held back so the joined deltas equal the stripped text."""

    def __init__(self, tokenizer: WhisperTokenizer):
        self.tokenizer = tokenizer
        self.token_ids: list[int] = []
        self.emitted = ""

    def add(self, token_ids: list[int]) -> str:
        if not token_ids:  # language or end-of-text steps: nothing new to decode
            return ""
        return self.update(self.token_ids + token_ids)

    def update(self, token_ids: list[int]) -> str:
        """The piece's text is now that of `token_ids` (a longer list than the last)."""
        self.token_ids = list(token_ids)
        text = self.tokenizer.decode(self.token_ids).strip()
        if text.endswith("\ufffd") or not text.startswith(self.emitted):
            return ""
        delta, self.emitted = text[len(self.emitted) :], text
        return delta

    def finish(self) -> str:
        text = self.tokenizer.decode(self.token_ids).strip()
        delta = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted += delta
        return delta


class TranscriptionJob:
    """Submits every piece as soon as it is cut (one encoder forward can take several) and
    yields text deltas in piece order; later pieces' outputs wait in their streams meanwhile."""

    _ids = itertools.count()

    def __init__(
        self,
        engine: AsyncEngineClient,
        tokenizer: WhisperTokenizer,
        audio: PreparedAudio,
        language: str | None,
        task: str,
        sampling_params: SamplingParams,
        max_completion_tokens: int | None,
        prompt: str | None = None,
        seek_continuation: bool = True,
        chunking: ChunkingStrategy | None = None,
        prompt_head: str | None = None,
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.audio = audio
        self.language = language  # the request's, or the first piece's detected one
        self._requested_language = language  # every piece's request takes this one
        self.task = task
        self.prompt = prompt
        self.prompt_head = prompt_head  # the request's keywords: in front of every prompt, kept whole
        self.max_completion_tokens = max_completion_tokens
        self.seek_continuation = seek_continuation
        self._find_speech = speech_finder(chunking) if chunking is not None else None  # (None: by energy)
        # Audio still being read has come out in pieces already, so it is longer than 30 s.
        self.sampling_params = long_form_params(sampling_params, audio.duration_s if audio.complete else math.inf)
        self.text = ""
        self._text_language: str | None = None  # of the piece whose text self.text ends with
        self.num_output_tokens = 0
        # Decodes (pieces and continuations) whose text the streamed transcript went through:
        # the streamed usage counts their audio, the same whenever the reading stopped.
        self.num_decodes_shown = 0
        # The streamed text's tokens and log-probabilities, in order, as they are shown (kept
        # when keep_logprobs is set: include[]=logprobs).
        self.keep_logprobs = False
        self.shown_logprobs: list[tuple[int, float]] = []
        self._shown_until_s = 0.0  # where the last of them ends in the audio
        self.first_token_time: float | None = None
        self.on_first_output: Callable[[], None] | None = None  # the engine has started on it
        self._prefix = f"tr-{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        self._next_piece = itertools.count()
        self._aborted = False
        self.requests: list[EngineRequest] = []
        self.pieces: list[PieceResult] = []
        self._samples: list[np.ndarray] = []
        self.streams: list[RequestStream] = []
        self._pieces_added = asyncio.Event()
        self._add_pieces(audio.pieces)

    @property
    def duration_s(self) -> float | None:
        """The audio's length, once it has all been read."""
        return self.audio.duration_s

    @property
    def seconds_transcribed(self) -> float:
        """The audio's length; for a stream that max_completion_tokens ended before the file was
        all read, where its last shown piece ends."""
        if self.duration_s is not None:
            return self.duration_s
        return self._shown_until_s

    def _add_pieces(self, pieces: list[AudioPiece]) -> None:
        # The prompt goes to every piece: they decode side by side, so none can take the text
        # of the piece before it as Whisper's sequential decoding does (continuations can).
        language = self._requested_language
        requests = [self._request(piece.samples, language, self.prompt, follows=bool(self.requests) or i > 0)
                    for i, piece in enumerate(pieces)]
        self.requests += requests
        self.pieces += [PieceResult(piece.start_seconds, len(piece.samples) / SAMPLE_RATE, language=language)
                        for piece in pieces]
        self._samples += [piece.samples for piece in pieces]
        self.streams += self.engine.add(requests) if requests else []

    async def _read_rest(self) -> None:
        """Submits each piece as the pool cuts it, until the audio has no more (or the job is
        aborted); run() and deltas() run it beside their own work."""
        try:
            while not self._aborted and (pieces := await self.audio.more()) is not None:
                self._add_pieces(pieces)
                self._pieces_added.set()
        finally:
            self._pieces_added.set()

    async def _has_piece(self, index: int, reader: asyncio.Future) -> bool:
        """Waits until piece `index` is submitted (True) or the audio has no more (False);
        raises what reading the audio raised."""
        while index >= len(self.streams):
            if reader.done():
                reader.result()
                return index < len(self.streams)
            self._pieces_added.clear()
            added = asyncio.ensure_future(self._pieces_added.wait())
            await asyncio.wait({reader, added}, return_when=asyncio.FIRST_COMPLETED)
            added.cancel()
        return True

    def _request(self, samples: np.ndarray, language: str | None, prompt: str | None,
                 params: SamplingParams | None = None, follows: bool = True) -> EngineRequest:
        """follows: not the audio's first piece (whose decode the stream's first text waits for)."""
        request_id = f"{self._prefix}-{next(self._next_piece)}"
        params = replace(params or self.sampling_params, follows_earlier_text=follows)
        return EngineRequest(request_id, samples, language, self.task, params, prompt, prompt_head=self.prompt_head)

    async def _continue(
        self, piece: PieceResult, samples: np.ndarray, depth: int, text_shown: bool = False
    ) -> tuple[RequestStream, PieceResult, np.ndarray] | None:
        """Submits the rest of a finished piece Whisper left unfinished (and cuts the piece's
        tokens where it starts): its stream, result and audio. None if the piece is done.
        Planned on a thread, where it may run Silero over the piece (~20 ms for 30 s): the
        piece is this chain's alone until then."""
        if not self.seek_continuation or self._aborted:
            return None
        plan_it = functools.partial(
            plan_continuation, self.tokenizer, piece, samples, depth, self.prompt, self.language,
            timestamps=self.sampling_params.timestamps, find_speech=self._find_speech, text_shown=text_shown,
        )
        plan = plan_it() if self._find_speech is None else await asyncio.to_thread(plan_it)
        if plan is None or self._aborted:
            return None
        language, params = continuation_language(self._requested_language, plan, self.sampling_params)
        request = self._request(plan.samples, language, plan.prompt, params)
        self.requests.append(request)
        return self.engine.add([request])[0], plan.result, plan.samples

    def _on_output(self, output) -> None:
        if self.on_first_output is not None:
            self.on_first_output()
            self.on_first_output = None
        if output.finish_reason == "error":
            raise (RuntimeError if output.bug else InvalidRequestError)(output.error)
        if output.language is not None and self.language is None:
            self.language = output.language
        if self.first_token_time is None and any(t < self.tokenizer.special.eot for t in output.new_token_ids):
            self.first_token_time = time.monotonic()

    async def deltas(self) -> AsyncIterator[str]:
        """Text as it is decoded, for streaming: the requests must decode once (no fallback,
        no silence judgement), since a delta once sent cannot be taken back. For the same
        reason a piece with timestamps shows only the segments a continuation cannot revoke
        (entrypoints.continuation.settled_length) until it finishes."""
        eot = self.tokenizer.special.eot
        reader = asyncio.ensure_future(self._read_rest())  # pieces go to the engine as they are cut
        try:
            index = 0
            while await self._has_piece(index, reader):
                async for delta in self._piece_deltas(index, eot):
                    yield delta
                if self._aborted:
                    return
                index += 1
        finally:
            reader.cancel()

    async def _piece_deltas(self, index: int, eot: int) -> AsyncIterator[str]:
        """The text of piece `index` and its continuations, as deltas; aborts the job at the
        token limit."""
        stream, piece, samples = self.streams[index], self.pieces[index], self._samples[index]
        depth, parent = 0, None
        while True:
            text = IncrementalText(self.tokenizer)
            piece_started, num_shown = False, 0
            budget = None if self.max_completion_tokens is None else self.max_completion_tokens - self.num_output_tokens
            self.num_decodes_shown += 1
            self._shown_until_s = max(self._shown_until_s, piece.offset_s + piece.duration_s)
            async for output in stream:
                self._on_output(output)
                assert not output.restarted, "a streamed request was decoded again"
                piece.add(output)
                if budget is not None and len(_text_tokens(piece.token_ids, eot, budget)) >= budget:
                    break  # the limit is reached: what came is all this transcription shows
                if parent is not None:
                    continue  # a continuation's opening words may be its parent's last ones again: held to its end
                settled = piece.token_ids[: settled_length(self.tokenizer, piece.token_ids)]
                shown = _text_tokens(settled, eot, budget)
                if self.keep_logprobs and len(shown) > num_shown:
                    self.shown_logprobs += _text_logprobs(piece, eot)[num_shown : len(shown)]
                    num_shown = len(shown)
                delta = text.update(shown)
                if delta:
                    yield self._add_text(delta, piece_started, piece)
                    piece_started = True
            if piece.summary is not None and piece.summary.num_attempts == 0:
                self.num_decodes_shown -= 1  # digital silence: the engine answered it without the model
            at_limit = budget is not None and len(_text_tokens(piece.token_ids, eot, budget)) >= budget
            following = None if at_limit else await self._continue(piece, samples, depth, text_shown=True)
            if parent is not None:
                drop_repeated_words(self.tokenizer, [parent, piece])  # as the whole transcript does
            shown = _text_tokens(piece.token_ids, eot, budget)
            if self.keep_logprobs:
                self.shown_logprobs += _text_logprobs(piece, eot)[num_shown : len(shown)]
            self.num_output_tokens += len(shown)
            delta = text.update(shown) + text.finish()
            if delta:
                yield self._add_text(delta, piece_started, piece)
            if at_limit:
                self.abort()
                return
            if following is None:
                break
            parent, (stream, piece, samples) = piece, following
            depth += 1

    def _add_text(self, delta: str, piece_started: bool, piece: PieceResult) -> str:
        """The delta of `piece` as the transcript takes it: before a later piece's first text,
        what joins it to the piece before (pieces.joiner, by the languages they are written in)."""
        language = written_in(piece.language or self.language, self.task)
        if not piece_started and self.text:
            delta = joiner(self._text_language, language) + delta
        self.text += delta
        self._text_language = language
        return delta

    async def run(self) -> str:
        """Waits for every piece's final decode (after any fallback and continuation) and
        returns the text; self.pieces holds each piece's tokens and summary, continuations in
        place after their parents. Past max_completion_tokens the rest is dropped."""
        reader = asyncio.ensure_future(self._read_rest())
        chains = []
        try:
            while await self._has_piece(len(chains), reader):
                index = len(chains)
                chains.append(asyncio.ensure_future(
                    self._decode_chain(self.streams[index], self.pieces[index], self._samples[index])
                ))
            done = [await chain for chain in chains]
        finally:
            reader.cancel()
            for chain in chains:  # a failed or cancelled job stops the rest of its pieces
                chain.cancel()
        self.pieces = [piece for chain in done for piece in chain]
        drop_repeated_words(self.tokenizer, self.pieces)
        # The first piece's language in time, not the first to be detected (as the join below reads it).
        self.language = spoken_language(self.pieces, self._requested_language, self.sampling_params.languages)
        if self.language is not None:
            for piece in self.pieces:
                piece.language = piece.language or self.language
        self.num_output_tokens = cap_text_tokens(self.pieces, self.max_completion_tokens, self.tokenizer.special.eot)
        self.text = transcript_text(self.tokenizer, self.pieces, self.language, self.task)
        return self.text

    async def _decode_chain(self, stream: RequestStream, piece: PieceResult, samples: np.ndarray) -> list[PieceResult]:
        """One piece and its continuations, decoded one after another."""
        chain = []
        while True:
            async for output in stream:
                self._on_output(output)
                piece.add(output)
            chain.append(piece)
            following = await self._continue(piece, samples, depth=len(chain) - 1)
            if following is None:
                return chain
            stream, piece, samples = following

    def abort(self) -> None:
        """Frees the engine work of every unfinished piece and continuation (no-op for
        finished ones); no continuation starts after it, and the audio is read no further."""
        self._aborted = True
        self.audio.cancel()
        self.engine.abort([request.request_id for request in self.requests])

    def text_logprobs(self) -> list[tuple[int, float]]:
        """The transcript's text tokens and their log-probabilities, in order (after run())."""
        eot = self.tokenizer.special.eot
        return [pair for piece in self.pieces if not piece.is_silence for pair in _text_logprobs(piece, eot)]


def _text_tokens(token_ids: list[int], eot: int, budget: int | None) -> list[int]:
    """The text tokens among `token_ids`, at most `budget` of them."""
    text = [token for token in token_ids if token < eot]
    return text if budget is None else text[: max(budget, 0)]


def _text_logprobs(piece: PieceResult, eot: int) -> list[tuple[int, float]]:
    return [(token, logprob) for token, logprob in zip(piece.token_ids, piece.logprobs) if token < eot]
