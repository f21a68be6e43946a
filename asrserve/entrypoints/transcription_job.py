"""One HTTP transcription: its audio pieces run as engine requests side by side, and their
text comes back in order, as deltas, joined the way offline transcription joins it."""

from __future__ import annotations

import itertools
import time
import uuid
from collections.abc import AsyncIterator, Callable

from asrserve.config import SAMPLE_RATE
from asrserve.engine.async_client import AsyncEngineClient
from asrserve.engine.engine_process import EngineRequest
from asrserve.engine.request import SamplingParams
from asrserve.entrypoints.pieces import PieceResult, separator_for, transcript_text
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
        self.token_ids.extend(token_ids)
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
    """Submits every piece at once (one encoder forward can take them all) and yields text
    deltas in piece order; later pieces' outputs wait in their streams meanwhile."""

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
    ):
        self.engine = engine
        self.tokenizer = tokenizer
        self.duration_s = audio.duration_s
        self.language = language
        self.max_completion_tokens = max_completion_tokens
        self.text = ""
        self.num_output_tokens = 0
        self.first_token_time: float | None = None
        self.on_first_output: Callable[[], None] | None = None  # the engine has started on it
        prefix = f"tr-{uuid.uuid4().hex[:12]}-{next(self._ids)}"
        # The prompt goes to every piece: they decode side by side, so none can take the text
        # of the piece before it as Whisper's sequential decoding does.
        self.requests = [
            EngineRequest(f"{prefix}-{index}", piece.samples, language, task, sampling_params, prompt)
            for index, piece in enumerate(audio.pieces)
        ]
        self.pieces = [
            PieceResult(piece.start_seconds, len(piece.samples) / SAMPLE_RATE, language=language)
            for piece in audio.pieces
        ]
        self.streams = engine.add(self.requests)

    def _on_output(self, output) -> None:
        if self.on_first_output is not None:
            self.on_first_output()
            self.on_first_output = None
        if output.finish_reason == "error":
            raise InvalidRequestError(output.error)
        if output.language is not None and self.language is None:
            self.language = output.language
        if self.first_token_time is None and any(t < self.tokenizer.special.eot for t in output.new_token_ids):
            self.first_token_time = time.monotonic()

    async def deltas(self) -> AsyncIterator[str]:
        """Text as it is decoded, for streaming: the requests must decode once (no fallback,
        no silence judgement), since a delta once sent cannot be taken back."""
        for stream in self.streams:
            piece = IncrementalText(self.tokenizer)
            piece_started = False
            async for output in stream:
                self._on_output(output)
                assert not output.restarted, "a streamed request was decoded again"
                tokens = [t for t in output.new_token_ids if t < self.tokenizer.special.eot]
                if self.max_completion_tokens is not None:
                    tokens = tokens[: self.max_completion_tokens - self.num_output_tokens]
                self.num_output_tokens += len(tokens)
                delta = piece.add(tokens)
                if self._at_token_limit:
                    delta += piece.finish()
                if delta:
                    if not piece_started and self.text:
                        delta = self._separator + delta
                    piece_started = True
                    self.text += delta
                    yield delta
                if self._at_token_limit:
                    self.abort()
                    return
            delta = piece.finish()
            if delta:
                if not piece_started and self.text:
                    delta = self._separator + delta
                self.text += delta
                yield delta

    async def run(self) -> str:
        """Waits for every piece's final decode (after any fallback) and returns the text;
        self.pieces holds each piece's tokens and summary. Past max_completion_tokens the
        remaining pieces are aborted and dropped."""
        eot = self.tokenizer.special.eot
        for index, (stream, piece) in enumerate(zip(self.streams, self.pieces)):
            async for output in stream:
                self._on_output(output)
                piece.add(output)
            if self.language is not None:
                piece.language = piece.language or self.language
            if piece.is_silence:
                continue
            if self.max_completion_tokens is not None:
                piece.truncate_text(self.max_completion_tokens - self.num_output_tokens, eot)
            self.num_output_tokens += piece.num_text_tokens(eot)
            if self._at_token_limit:
                self.abort()
                del self.pieces[index + 1 :]
                break
        self.text = transcript_text(self.tokenizer, self.pieces, self.language)
        return self.text

    def abort(self) -> None:
        """Frees the engine work of every unfinished piece (no-op for finished ones)."""
        self.engine.abort([request.request_id for request in self.requests])

    @property
    def _separator(self) -> str:
        return separator_for(self.language)

    @property
    def _at_token_limit(self) -> bool:
        return self.max_completion_tokens is not None and self.num_output_tokens >= self.max_completion_tokens
