"""Offline transcription: `ASR("tiny.en").transcribe(files)`, the engine driven in-process."""

from __future__ import annotations

import itertools
import numbers
from collections import deque
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field, replace
from pathlib import Path

import numpy as np

from asrserve.audio.chunking import DEFAULT_CHUNKING, ChunkingStrategy, cut_audio
from asrserve.audio.decode import AudioError, AudioSource, load_audio
from asrserve.audio.vad import VADUnavailableError
from asrserve.config import SAMPLE_RATE, CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from asrserve.engine.engine_core import EngineCore
from asrserve.engine.request import RequestOutput, SamplingParams
from asrserve.entrypoints.continuation import (
    continuation_language, drop_repeated_words, plan_continuation, speech_finder,
)
from asrserve.entrypoints.offline_engine import SharedEngine
from asrserve.entrypoints.offline_inputs import input_languages, input_sources
from asrserve.entrypoints.protocol import keywords_text
from asrserve.entrypoints.pieces import (
    PieceResult, cap_text_tokens, decode_to_the_end, long_form_params, spoken_language, transcript_text,
)
from asrserve.entrypoints.segments import Segment, Word, build_segments
from asrserve.errors import InvalidRequestError


@dataclass
class Transcription:
    text: str
    language: str | None
    duration: float  # seconds of input audio
    token_ids: list[int] = field(default_factory=list)  # every piece's output tokens, in order
    avg_logprob: float | None = None
    source: str | None = None  # the file name, when the input was a file
    error: str | None = None  # why this input produced no transcript (errors="return")
    # With timestamps=True: the segments (with their words if word_timestamps=True).
    segments: list[Segment] | None = None
    pieces: list[PieceResult] = field(default_factory=list, repr=False)

    @property
    def words(self) -> list[Word]:
        return [word for segment in self.segments or [] for word in segment.words]


@dataclass
class _Job:
    """One input: its pieces become engine requests; it completes when all of them do."""

    index: int
    source: str | None
    duration: float = 0.0
    pieces: list[PieceResult] = field(default_factory=list)
    remaining: int = 0
    error: str | None = None
    params: SamplingParams | None = None  # what its pieces decode with
    language: str | None = None  # the caller's, for this input (None: detect it)


@dataclass
class _PieceRequest:
    """An engine request for one piece (or a continuation of one) of a job."""

    job: _Job
    result: PieceResult
    samples: np.ndarray
    depth: int = 0  # continuations before this one


class ASR:
    """A Whisper model behind the continuous-batching engine, for in-process use.

    model: a hub id, local directory, short name ("tiny.en", "base", ...) or None for the
    bundled default. The remaining arguments configure the engine (see asrserve.config).
    """

    def __init__(
        self,
        model: str | None = None,
        *,
        dtype: str = "auto",
        device: str = "auto",
        load_format: str = "auto",
        max_num_seqs: int | None = None,
        max_encoder_batch: int | None = None,
        block_size: int = 16,
        num_kv_blocks: int | None = None,
        kv_cache_memory_gb: float | None = None,
        gpu_memory_utilization: float = 0.9,
        compile: str = "auto",
        encoder_quantization: str = "auto",
        enforce_eager: bool = False,
    ):
        config = EngineConfig(
            model=ModelConfig(
                model=model, dtype=dtype, device=device, load_format=load_format, compile=compile,
                encoder_quantization=encoder_quantization, enforce_eager=enforce_eager,
            ),
            cache=CacheConfig(
                block_size=block_size, num_kv_blocks=num_kv_blocks, kv_cache_memory_gb=kv_cache_memory_gb,
                gpu_memory_utilization=gpu_memory_utilization,
            ),
            scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_encoder_batch=max_encoder_batch),
        )
        self.engine = EngineCore(config)
        self.tokenizer = self.engine.tokenizer
        self._shared = SharedEngine(self.engine)  # for calls inside, beside or beyond another
        self._next_id = itertools.count()

    def transcribe(
        self,
        audio: AudioSource | Iterable[AudioSource],
        *,
        language: str | Sequence[str | None] | None = None,
        task: str = "transcribe",
        temperature: float = 0.0,
        seed: int | None = None,
        max_tokens: int | None = None,
        errors: str = "raise",
        progress: bool = False,
        timestamps: bool = False,
        word_timestamps: bool = False,
        prompt: str | None = None,
        fallback: bool = True,
        best_of: int | None = None,
        chunking_strategy: str | dict | ChunkingStrategy | None = None,
        seek_continuation: bool = True,
        languages: Sequence[str] = (),
        keywords: Sequence[str] = (),
    ) -> list[Transcription]:
        """Transcribes one input or many (paths, encoded bytes, or 16 kHz float arrays).

        Audio longer than 30 s is cut into pieces that are transcribed together, with timestamp
        tokens (Whisper's long-form mode, whatever the output): chunking_strategy "auto" or
        {"type": "server_vad", ...} (the default, OpenAI's field) cuts at voice-activity
        boundaries, skipping non-speech; "energy" cuts at quiet points. seek_continuation: decode the rest of a
        piece again from its last segment when Whisper stopped early in it.
        language: one code for every input, or one per input (None: detect it), so files in
        several languages still decode side by side. languages: those the audio may be in (OpenAI's
        field): detection picks among them. keywords: words and phrases to expect (OpenAI's), read
        in front of the prompt.
        errors="raise" raises InvalidRequestError for a bad argument before anything runs, and
        AudioError for the first input that cannot be read when it is read (inputs are read as
        the engine makes room; results before it are dropped); errors="return" gives that
        input a Transcription with `error` set.
        timestamps: decode with timestamp tokens and return segments; word_timestamps: also
        time each word (implies timestamps). prompt: text that came before the audio.
        fallback: at temperature 0, retry pieces that fail Whisper's checks at higher
        temperatures and drop pieces judged silence (OpenAI's semantics); False decodes once.
        The fallback temperatures decode side by side, not one after another.
        best_of: samples drawn at each temperature above 0, the likeliest kept (default 5 with
        fallback on, 1 without). max_tokens: text tokens of each whole transcript at most (the
        server's max_completion_tokens; the text past it is dropped).
        """
        sources = list(input_sources(audio, language))
        results: list[Transcription | None] = [None] * len(sources)
        for index, transcription in self.transcribe_iter(
            sources, language=language, task=task, temperature=temperature, seed=seed,
            max_tokens=max_tokens, errors=errors, progress=progress, timestamps=timestamps,
            word_timestamps=word_timestamps, prompt=prompt, fallback=fallback, best_of=best_of,
            chunking_strategy=chunking_strategy, seek_continuation=seek_continuation, languages=languages,
            keywords=keywords,
        ):
            results[index] = transcription
        return results  # type: ignore[return-value]

    def transcribe_iter(
        self,
        sources: AudioSource | Iterable[AudioSource],
        *,
        language: str | Sequence[str | None] | None = None,
        task: str = "transcribe",
        temperature: float = 0.0,
        seed: int | None = None,
        max_tokens: int | None = None,
        errors: str = "raise",
        progress: bool = False,
        max_in_flight: int | None = None,
        timestamps: bool = False,
        word_timestamps: bool = False,
        prompt: str | None = None,
        fallback: bool = True,
        best_of: int | None = None,
        chunking_strategy: str | dict | ChunkingStrategy | None = None,
        seek_continuation: bool = True,
        languages: Sequence[str] = (),
        keywords: Sequence[str] = (),
    ) -> Iterator[tuple[int, Transcription]]:
        """Yields (input index, transcription) as each input completes. Inputs are decoded
        lazily, keeping at most max_in_flight pieces queued, so a long list of files (or a
        generator of them) never sits in memory at once."""
        if errors not in ("raise", "return"):
            raise ValueError("errors must be 'raise' or 'return'")
        if prompt is not None and not isinstance(prompt, str):
            raise InvalidRequestError(f"prompt must be text, got {type(prompt).__name__}")
        for name, value in (("fallback", fallback), ("timestamps", timestamps), ("word_timestamps", word_timestamps)):
            if not isinstance(value, (bool, np.bool_)):  # ("no" is true)
                raise InvalidRequestError(f"{name} must be True or False, got {value!r}", param=name)
        languages, keywords = languages or (), keywords or ()  # (None: none, as for language and prompt)
        if isinstance(keywords, str) or not all(isinstance(keyword, str) for keyword in keywords):
            raise InvalidRequestError("keywords must be a list of words or phrases")
        prompt_head = keywords_text(keywords)  # in front of every piece's prompt, kept whole
        if max_in_flight is not None and (not isinstance(max_in_flight, numbers.Integral) or max_in_flight < 0):
            raise InvalidRequestError(f"max_in_flight must be a positive integer (0: the default), got {max_in_flight!r}")
        sources = input_sources(sources, language)
        count = len(sources) if hasattr(sources, "__len__") else None
        timestamps = timestamps or word_timestamps
        try:
            params = SamplingParams.transcription(
                temperature, decode_once=not fallback, seed=seed, max_tokens=max_tokens, timestamps=timestamps,
                word_timestamps=word_timestamps, best_of=best_of,
            )
        except ValueError as error:
            raise InvalidRequestError(str(error)) from None
        # The engine stops each decode near max_tokens (with timestamps, at the end of the segment
        # the limit falls in); _finish cuts the whole transcript there, as the server does
        # (continuations and later pieces decode past it).
        params = decode_to_the_end(params)
        text_limit = max_tokens
        language_of, choice = input_languages(self.engine, language, languages, count, task)
        params = replace(params, languages=choice)
        try:
            strategy = ChunkingStrategy.parse(chunking_strategy, DEFAULT_CHUNKING)
        except ValueError as error:
            raise InvalidRequestError(f"chunking_strategy: {error}") from None
        find_speech = speech_finder(strategy)
        max_in_flight = max_in_flight or 2 * self.engine.config.scheduler.max_num_seqs
        shared = self._shared
        pending = iter(enumerate(sources))
        requests: dict[str, _PieceRequest] = {}  # in the engine, by request id
        inbox: deque[RequestOutput] = deque()  # their outputs, whichever call stepped the engine
        in_flight = 0
        bar = _progress_bar(count) if progress else None

        def add(job: _Job, piece: _PieceRequest, piece_language: str | None, piece_prompt: str | None,
                piece_params: SamplingParams | None = None) -> None:
            request_id = f"offline-{next(self._next_id)}"
            shared.add(inbox, request_id, piece.samples, piece_language, task, piece_params or job.params, piece_prompt,
                       prompt_head=prompt_head)
            requests[request_id] = piece
            job.remaining += 1

        def submit(index: int, source: AudioSource) -> _Job:
            job = _Job(index, str(source) if isinstance(source, (str, Path)) else None, language=language_of(index))
            try:
                samples = load_audio(source)
                pieces = cut_audio(samples, strategy)
            except (AudioError, VADUnavailableError) as error:  # the VAD: audio over 30 s where it cannot load
                if errors == "raise":
                    raise
                job.error = str(error) if isinstance(error, AudioError) else f"{error} (or use chunking strategy 'energy')"
                return job
            job.duration = len(samples) / SAMPLE_RATE
            job.params = long_form_params(params, job.duration)
            for piece in pieces:
                result = PieceResult(piece.start_seconds, len(piece.samples) / SAMPLE_RATE, language=job.language)
                job.pieces.append(result)
                add(job, _PieceRequest(job, result, piece.samples), job.language, prompt)
            return job

        def finished(piece: _PieceRequest) -> int:
            """Continues the piece if Whisper left it unfinished; returns the requests added."""
            if not seek_continuation:
                return 0
            plan = plan_continuation(self.tokenizer, piece.result, piece.samples, piece.depth, prompt,
                                     piece.job.language, timestamps=piece.job.params.timestamps, find_speech=find_speech)
            if plan is None:
                return 0
            pieces = piece.job.pieces
            pieces.insert(pieces.index(piece.result) + 1, plan.result)
            language, piece_params = continuation_language(piece.job.language, plan, piece.job.params)
            add(piece.job, _PieceRequest(piece.job, plan.result, plan.samples, piece.depth + 1), language, plan.prompt,
                piece_params)
            return 1

        try:
            exhausted = False
            while True:
                while not exhausted and in_flight < max_in_flight:
                    item = next(pending, None)
                    if item is None:
                        exhausted = True
                        break
                    job = submit(*item)
                    if job.remaining == 0:
                        if bar is not None:
                            bar.update(1)
                        yield job.index, self._finish(job, params, text_limit, task)
                    in_flight += job.remaining
                if not requests:
                    break
                shared.step_for(inbox)
                while inbox:
                    output = inbox.popleft()
                    if output.finish_reason == "error":  # (a step another call made failed)
                        raise (RuntimeError if output.bug else InvalidRequestError)(output.error)
                    piece = requests[output.request_id]
                    piece.result.add(output)
                    if output.finished:
                        del requests[output.request_id]
                        job = piece.job
                        added = finished(piece)
                        in_flight += added - 1
                        job.remaining -= 1
                        if job.remaining == 0:
                            if bar is not None:
                                bar.update(1)
                            yield job.index, self._finish(job, params, text_limit, task)
        finally:
            shared.release(list(requests))  # the caller stopped early: free everything
            if bar is not None:
                bar.close()

    def _finish(self, job: _Job, params: SamplingParams, text_limit: int | None, task: str) -> Transcription:
        if job.error is not None:
            return Transcription("", None, 0.0, source=job.source, error=job.error)
        drop_repeated_words(self.tokenizer, job.pieces)
        cap_text_tokens(job.pieces, text_limit, self.tokenizer.special.eot)
        language = spoken_language(job.pieces, job.language, params.languages) if self.engine.is_multilingual else "en"
        spoken = [piece for piece in job.pieces if not piece.is_silence]
        is_timestamp = self.tokenizer.is_timestamp
        all_logprobs = [lp for piece in spoken for lp in piece.logprobs]
        segments = None
        if params.timestamps:
            segments = build_segments(self.tokenizer, job.pieces, language, words=params.word_timestamps, task=task)
        return Transcription(
            text=transcript_text(self.tokenizer, job.pieces, language, task),
            language=language,
            duration=job.duration,
            token_ids=[t for piece in spoken for t in piece.token_ids if params.timestamps or not is_timestamp(t)],
            avg_logprob=sum(all_logprobs) / len(all_logprobs) if all_logprobs else None,
            source=job.source,
            segments=segments,
            pieces=job.pieces,
        )


def _progress_bar(total: int):
    from tqdm import tqdm

    return tqdm(total=total, unit="file", desc="transcribing", dynamic_ncols=True)


__all__ = ["ASR", "Transcription", "Segment", "Word", "AudioError", "InvalidRequestError"]
