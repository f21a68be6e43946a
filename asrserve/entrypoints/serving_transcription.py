"""OpenAI's audio API: POST /v1/audio/transcriptions and /v1/audio/translations.

One request: authorize → admit (--max-waiting-requests) → read the multipart upload → validate
the form → decode and cut the audio in the preprocessing pool → run its pieces on the engine →
render the response format, or stream text deltas as server-sent events."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response

from asrserve.audio.chunking import DEFAULT_CHUNKING, ChunkingStrategy
from asrserve.audio.decode import AudioError
from asrserve.engine.async_client import EngineDeadError
from asrserve.engine.request import SamplingParams
from asrserve.engine.request_checks import check_languages
from asrserve.entrypoints.admission import AudioHeld, WaitingSlot
from asrserve.entrypoints.auth import authorize
from asrserve.entrypoints.error_handlers import audio_error, engine_dead_error, job_error, shutting_down_error
from asrserve.entrypoints.formats import CONTENT_TYPES, to_srt, to_verbose_json, to_vtt
from asrserve.entrypoints.middleware import CLIENT_CLOSED_REQUEST
from asrserve.entrypoints.pieces import decode_to_the_end
from asrserve.entrypoints.preprocess import PreparedAudio
from asrserve.entrypoints.protocol import (
    TIMESTAMPED_FORMATS,
    APIError,
    TranscriptionRequest,
    usage_duration,
)
from asrserve.entrypoints.segments import build_segments
from asrserve.entrypoints.server_state import ServerState
from asrserve.entrypoints.serving_models import check_model_name
from asrserve.entrypoints.transcription_job import TranscriptionJob
from asrserve.entrypoints.transcription_stream import (
    CleanupStreamingResponse,
    StreamOutcome,
    logprob_entries,
    record_job,
    sse_events,
)
from asrserve.entrypoints.upload import ClientGone, read_form
from asrserve.errors import InvalidRequestError

T = TypeVar("T")


def add_transcription_routes(app: FastAPI, state: ServerState) -> None:
    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request) -> Response:
        return await _audio_endpoint(request, state, "transcribe", "transcriptions")

    @app.post("/v1/audio/translations")
    async def translations(request: Request) -> Response:
        return await _audio_endpoint(request, state, "translate", "translations")


async def _audio_endpoint(request: Request, state: ServerState, task: str, endpoint: str) -> Response:
    arrival = time.monotonic()
    config = state.config
    authorize(request.headers, state.api_key_digests)
    state.check_ready()
    if state.num_waiting >= config.max_waiting_requests:
        raise APIError(
            429, f"the server is at capacity ({state.num_waiting} requests waiting); retry shortly",
            type="rate_limit_error", code="server_busy", headers={"Retry-After": "1"},
        )
    waiting = WaitingSlot(state)
    try:
        try:
            form = await read_form(request, int(config.max_audio_filesize_mb * 1024 * 1024),
                                   config.upload_idle_timeout_s, min_rate_bytes_s=config.upload_min_rate_kb_s * 1000,
                                   text_fields=TranscriptionRequest.model_fields)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        params = TranscriptionRequest.from_form(form.fields)
        check_model_name(params.model, state)
        _check_format(params)
        try:
            language, languages = check_languages(state.tokenizer, state.model_name, params.language,
                                                  params.languages, task)
        except InvalidRequestError as error:
            raise APIError(400, str(error), param=error.param or "language") from None
        job_params = TranscriptionParams(language, task, params, endpoint, arrival, state.chunking_strategy,
                                         request_id=getattr(request.state, "request_id", None), languages=languages)
        return await _until_disconnect(request, _transcribe(state, form.file, job_params, waiting))
    except asyncio.CancelledError:
        if not state.shutting_down:
            raise
        # uvicorn cancels what outlasts --graceful-shutdown-timeout-s (an upload still arriving
        # too), and at once where the engine died: say so, in our shape.
        raise (engine_dead_error(state.engine.error) if state.engine.failed.is_set() else shutting_down_error()) from None
    finally:
        if not waiting.handed_off:
            waiting.release()


def _check_format(params: TranscriptionRequest) -> None:
    if params.stream and params.response_format in TIMESTAMPED_FORMATS:
        raise APIError(
            400, f"response_format {params.response_format!r} is not available with stream=true: streaming sends "
            "text deltas; use json or text, or stream=false", param="stream",
        )
    if params.include and params.response_format != "json":
        raise APIError(400, "include[]=logprobs needs response_format=json", param="include")
    if "word" in params.timestamp_granularities and params.response_format != "verbose_json":
        raise APIError(
            400, "timestamp_granularities[]=word needs response_format=verbose_json", param="timestamp_granularities",
        )


class TranscriptionParams:
    """A validated request as the engine and the renderer need it."""

    def __init__(
        self, language: str | None, task: str, params: TranscriptionRequest, endpoint: str, arrival: float,
        default_chunking: ChunkingStrategy = DEFAULT_CHUNKING, request_id: str | None = None,
        languages: tuple[str, ...] = (),
    ):
        self.request_id = request_id  # (named in the log line of a stream that fails)
        self.chunking = _chunking_strategy(params.chunking_strategy, default_chunking)
        self.language = language
        self.task = task
        self.request = params
        self.endpoint = endpoint
        self.arrival = arrival
        self.timestamps = params.response_format in TIMESTAMPED_FORMATS
        self.words = "word" in params.timestamp_granularities
        self.segments = not self.words or "segment" in params.timestamp_granularities
        decode_once = params.stream or not params.temperature_fallback
        if params.stream and params.best_of is not None and params.best_of > 1:
            # Streamed text is sent as it is decoded: there is one sample to send.
            raise APIError(400, "best_of: a streamed transcription decodes one sample", param="best_of")
        # The job cuts the text at max_completion_tokens (decoded to the end with words).
        self.sampling = decode_to_the_end(SamplingParams.transcription(
            params.temperature, decode_once=decode_once, seed=params.seed, max_tokens=params.max_completion_tokens,
            timestamps=self.timestamps, word_timestamps=self.words, best_of=params.best_of,
            ignore_eos=params.ignore_eos, stream_tokens=params.stream, languages=languages,
        ))


def _chunking_strategy(value: str | dict | None, default: ChunkingStrategy) -> ChunkingStrategy:
    try:
        return ChunkingStrategy.parse(value, default)
    except ValueError as error:
        raise APIError(400, f"chunking_strategy: {error}", param="chunking_strategy") from None


async def _transcribe(
    state: ServerState, audio: bytearray, job_params: TranscriptionParams, waiting: WaitingSlot
) -> Response:
    try:
        prepared = await state.pool.prepare(audio, job_params.chunking)
    except AudioError as error:
        raise audio_error(error) from None
    del audio
    try:
        held = AudioHeld(state, prepared.expected_s)
    except APIError:
        prepared.cancel()
        raise
    prepared.on_read = held.grow
    prepared.on_complete = held.settle
    try:
        return await _run_job(state, prepared, job_params, waiting, held)
    finally:
        if not waiting.handed_off:
            held.release()


async def _run_job(
    state: ServerState, prepared: PreparedAudio, job_params: TranscriptionParams, waiting: WaitingSlot,
    held: AudioHeld,
) -> Response:
    try:
        job = TranscriptionJob(
            state.engine, state.tokenizer, prepared, job_params.language, job_params.task, job_params.sampling,
            job_params.request.max_completion_tokens, job_params.request.prompt, chunking=job_params.chunking,
            prompt_head=job_params.request.prompt_head,
        )
    except EngineDeadError as error:
        prepared.cancel()  # the rest of the file need not be read
        raise engine_dead_error(error) from None
    job.on_first_output = waiting.release
    job.keep_logprobs = bool(job_params.request.include)
    if job_params.request.stream:
        waiting.handed_off = True  # the response releases it, however the stream ends

        def cleanup() -> None:
            job.abort()
            waiting.release()
            held.release()

        outcome = StreamOutcome()
        return CleanupStreamingResponse(
            sse_events(state, job, job_params, outcome),
            cleanup,
            outcome,
            lambda: state.shutting_down,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        text = await job.run()
    except (EngineDeadError, InvalidRequestError, AudioError) as error:  # (audio: found after the first pieces)
        raise job_error(error) from None
    finally:
        job.abort()
    record_job(state, job, job_params)
    return _render(state, job, job_params, text)


def _render(state: ServerState, job: TranscriptionJob, job_params: TranscriptionParams, text: str) -> Response:
    response_format = job_params.request.response_format
    if response_format == "text":
        return PlainTextResponse(text + "\n")
    if response_format == "json":
        body = {"text": text, "usage": usage_duration(job.duration_s)}
        if job_params.request.include:
            body["logprobs"] = logprob_entries(state, job.text_logprobs())
        return JSONResponse(body)
    segments = build_segments(state.tokenizer, job.pieces, job.language, words=job_params.words, task=job.task)
    if response_format == "srt":
        return Response(to_srt(segments), media_type=CONTENT_TYPES["srt"])
    if response_format == "vtt":
        return Response(to_vtt(segments), media_type=CONTENT_TYPES["vtt"])
    return JSONResponse(
        to_verbose_json(job_params.task, job.language, job.duration_s, text, segments, job_params.words,
                        usage_duration(job.duration_s), with_segments=job_params.segments)
    )


async def _until_disconnect(request: Request, work: Awaitable[T]) -> T | Response:
    """Runs `work` (the body has been read) and cancels it if the client disconnects first:
    cancellation aborts its engine requests and drops its queued preprocessing job."""
    work_task = asyncio.ensure_future(work)
    listener = asyncio.ensure_future(_wait_for_disconnect(request))
    try:
        done, _ = await asyncio.wait({work_task, listener}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        work_task.cancel()
        raise
    finally:
        listener.cancel()
    if work_task in done:
        return work_task.result()
    work_task.cancel()
    try:
        await work_task
    except (asyncio.CancelledError, Exception):
        pass
    return Response(status_code=CLIENT_CLOSED_REQUEST)


async def _wait_for_disconnect(request: Request) -> None:
    while (await request.receive())["type"] != "http.disconnect":
        pass
