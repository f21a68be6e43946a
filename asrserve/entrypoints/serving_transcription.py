"""OpenAI's audio API: POST /v1/audio/transcriptions and /v1/audio/translations.

One request: authorize → admit (--max-waiting-requests) → read the multipart upload → validate
the form → decode and cut the audio in the preprocessing pool → run its pieces on the engine →
render the response format, or stream text deltas as server-sent events."""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import TypeVar

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from asrserve.audio.chunking import DEFAULT_CHUNKING, ChunkingStrategy
from asrserve.audio.decode import AudioError, AudioTooLongError
from asrserve.engine.async_client import EngineDeadError
from asrserve.engine.request import SamplingParams
from asrserve.engine.request_checks import check_language
from asrserve.entrypoints.admission import AudioHeld, WaitingSlot
from asrserve.entrypoints.auth import authorize
from asrserve.entrypoints.error_handlers import engine_dead_error, shutting_down_error
from asrserve.entrypoints.formats import CONTENT_TYPES, to_srt, to_verbose_json, to_vtt
from asrserve.entrypoints.live_decode import logprob_entry
from asrserve.entrypoints.middleware import CLIENT_CLOSED_REQUEST, CLIENT_CLOSED_SCOPE_KEY
from asrserve.entrypoints.pieces import decode_to_the_end
from asrserve.entrypoints.preprocess import PreparedAudio
from asrserve.entrypoints.protocol import (
    TIMESTAMPED_FORMATS,
    APIError,
    TranscriptionRequest,
    error_body,
    usage_duration,
    usage_tokens,
)
from asrserve.entrypoints.segments import build_segments
from asrserve.entrypoints.server_state import ServerState
from asrserve.entrypoints.serving_models import check_model_name
from asrserve.entrypoints.transcription_job import TranscriptionJob
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
                                   config.upload_idle_timeout_s, min_rate_bytes_s=config.upload_min_rate_kb_s * 1000)
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        params = TranscriptionRequest.from_form(form.fields)
        check_model_name(params.model, state)
        _check_format(params)
        try:
            language = check_language(state.tokenizer, state.model_name, params.language, task)
        except InvalidRequestError as error:
            raise APIError(400, str(error), param="language" if params.language else "model") from None
        job_params = TranscriptionParams(language, task, params, endpoint, arrival, state.chunking_strategy)
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
        default_chunking: ChunkingStrategy = DEFAULT_CHUNKING,
    ):
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
            ignore_eos=params.ignore_eos, stream_tokens=params.stream,
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
        raise _audio_error(error) from None
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


def _audio_error(error: AudioError) -> APIError:
    code = "audio_too_long" if isinstance(error, AudioTooLongError) else "invalid_audio"
    return APIError(400, str(error), param="file", code=code)


async def _run_job(
    state: ServerState, prepared: PreparedAudio, job_params: TranscriptionParams, waiting: WaitingSlot,
    held: AudioHeld,
) -> Response:
    try:
        job = TranscriptionJob(
            state.engine, state.tokenizer, prepared, job_params.language, job_params.task, job_params.sampling,
            job_params.request.max_completion_tokens, job_params.request.prompt,
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

        return _CleanupStreamingResponse(
            _sse_events(state, job, job_params),
            cleanup,
            lambda: state.shutting_down,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        text = await job.run()
    except EngineDeadError as error:
        raise engine_dead_error(error) from None
    except InvalidRequestError as error:
        raise APIError(400, str(error)) from None
    except AudioError as error:  # found in the part of the file read after the first pieces
        raise _audio_error(error) from None
    finally:
        job.abort()
    _record_job(state, job, job_params)
    return _render(state, job, job_params, text)


def _render(state: ServerState, job: TranscriptionJob, job_params: TranscriptionParams, text: str) -> Response:
    response_format = job_params.request.response_format
    if response_format == "text":
        return PlainTextResponse(text + "\n")
    if response_format == "json":
        body = {"text": text, "usage": usage_duration(job.duration_s)}
        if job_params.request.include:
            body["logprobs"] = _logprob_entries(state, job.text_logprobs())
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


class _CleanupStreamingResponse(StreamingResponse):
    """Runs `cleanup` when the response ends for any reason, even if the client left before
    the first byte and the event generator never started. A stream the server's drain cut off
    (--graceful-shutdown-timeout-s ran out) ends with the `shutting_down` error a request not
    streamed gets, rather than mid-body with a traceback in the log."""

    def __init__(self, content, cleanup: Callable[[], None], shutting_down: Callable[[], bool], **kwargs):
        super().__init__(content, **kwargs)
        self.cleanup = cleanup
        self.shutting_down = shutting_down

    async def __call__(self, scope, receive, send) -> None:
        started = ended = done = False

        async def send_and_note(message) -> None:
            nonlocal started, ended, done
            started = started or message["type"] == "http.response.start"
            ended = ended or (message["type"] == "http.response.body" and not message.get("more_body", False))
            done = done or b"data: [DONE]" in message.get("body", b"")
            await send(message)

        try:
            await super().__call__(scope, receive, send_and_note)
            if not ended:  # Starlette stops a stream whose client left, and returns
                scope[CLIENT_CLOSED_SCOPE_KEY] = True
        except asyncio.CancelledError:
            if not (started and self.shutting_down()) or ended:
                raise  # (before the headers, the server answers 503 itself)
            last = b"" if done else _sse(shutting_down_error().body()).encode()  # none after [DONE]
            await send({"type": "http.response.body", "body": last, "more_body": False})
        finally:
            self.cleanup()


async def _sse_events(state: ServerState, job: TranscriptionJob, job_params: TranscriptionParams) -> AsyncIterator[str]:
    include_logprobs, sent = bool(job_params.request.include), 0
    try:
        async for delta in job.deltas():
            event = {"type": "transcript.text.delta", "delta": delta}
            if include_logprobs:  # the tokens this delta's text came from
                event["logprobs"] = _logprob_entries(state, job.shown_logprobs[sent:])
                sent = len(job.shown_logprobs)
            yield _sse(event)
        # Each decode reads a window's 1500 audio positions and a prompt (the request's, at most 223 tokens).
        prompt_tokens = state.tokenizer.num_prompt_tokens(job_params.request.prompt)
        usage = usage_tokens(job.num_decodes_shown * 1500, job.num_decodes_shown * prompt_tokens, job.num_output_tokens)
        done = {"type": "transcript.text.done", "text": job.text, "usage": usage}
        if include_logprobs:
            done["logprobs"] = _logprob_entries(state, job.shown_logprobs)
        yield _sse(done)
        yield "data: [DONE]\n\n"
        _record_job(state, job, job_params)
    except EngineDeadError as error:
        yield _sse(error_body(f"the engine stopped: {error}", "server_error", code="engine_dead"))
    except InvalidRequestError as error:
        yield _sse(error_body(str(error), "invalid_request_error"))
    except AudioError as error:
        yield _sse(_audio_error(error).body())
    except APIError as error:  # the file grew past --max-audio-in-flight-s as it was read
        yield _sse(error.body())
    except Exception:  # a bug: the client still learns that the stream failed, as a 500 would say
        logging.getLogger("asrserve.server").exception("a transcription stream failed")
        yield _sse(error_body("internal server error: this is a bug in asrserve; the log has the details", "server_error"))
    finally:
        job.abort()


def _logprob_entries(state: ServerState, tokens: list[tuple[int, float]]) -> list[dict]:
    return [logprob_entry(state.tokenizer, token, logprob) for token, logprob in tokens]


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _record_job(state: ServerState, job: TranscriptionJob, job_params: TranscriptionParams) -> None:
    metrics, endpoint = state.metrics, job_params.endpoint
    metrics.audio_seconds.labels(endpoint).inc(job.seconds_transcribed)
    metrics.output_tokens.labels(endpoint).inc(job.num_output_tokens)
    if job.first_token_time is not None:
        metrics.time_to_first_token.labels(endpoint).observe(job.first_token_time - job_params.arrival)


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
