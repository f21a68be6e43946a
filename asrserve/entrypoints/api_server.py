"""The OpenAI-compatible HTTP server. The event loop only parses, routes and streams: uploads
are decoded in the preprocessing pool and transcribed by the engine process."""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from asrserve import __version__
from asrserve.audio.decode import AudioError, AudioTooLongError
from asrserve.config import DEFAULT_MODEL, EngineConfig, ServerConfig
from asrserve.engine.async_client import AsyncEngineClient, EngineDeadError
from asrserve.engine.request import SamplingParams
from asrserve.engine.request_checks import check_language
from asrserve.entrypoints.formats import CONTENT_TYPES, to_srt, to_verbose_json, to_vtt
from asrserve.entrypoints.metrics import ServerMetrics
from asrserve.entrypoints.preprocess import PreprocessPool, default_preprocess_workers
from asrserve.entrypoints.protocol import (
    TIMESTAMPED_FORMATS,
    APIError,
    TranscriptionRequest,
    error_body,
    usage_duration,
    validation_error,
)
from asrserve.entrypoints.segments import build_segments
from asrserve.entrypoints.transcription import TranscriptionJob
from asrserve.entrypoints.upload import ClientGone, read_form
from asrserve.errors import InvalidRequestError, shown
from asrserve.model.tokenizer import WhisperTokenizer

logger = logging.getLogger("asrserve.server")

T = TypeVar("T")

ENDPOINTS = {
    "/v1/audio/transcriptions": "transcriptions",
    "/v1/audio/translations": "translations",
    "/v1/models": "models",
    "/health": "health",
    "/version": "version",
    "/metrics": "metrics",
}
CLIENT_CLOSED_REQUEST = 499  # nginx's code for "the client left first"; logged, never sent


class ServerState:
    """Everything the routes share, kept on app.state.asr."""

    def __init__(self, config: ServerConfig, engine_config: EngineConfig):
        self.config = config
        self.engine = AsyncEngineClient(engine_config, log_level=logging.getLevelName(config.log_level.upper()))
        self.pool = PreprocessPool(
            config.preprocess_workers or default_preprocess_workers(), config.max_audio_duration_s
        )
        self.metrics = ServerMetrics()
        self.engine.on_stats = self.metrics.record_engine
        self.engine.on_abort = self.metrics.engine_requests_aborted.inc
        self.served_model_names = config.served_model_names or [engine_config.model.model or DEFAULT_MODEL]
        self.api_key_digests = [_digest(key) for key in config.api_keys]  # computed once, not per request
        self.tokenizer: WhisperTokenizer | None = None
        self.num_waiting = 0  # accepted transcriptions that have produced no text yet
        self.uvicorn_server = None  # set by run_server, so that a dead engine can stop it
        self.exit_code = 0

    @property
    def shutting_down(self) -> bool:
        return self.uvicorn_server is not None and self.uvicorn_server.should_exit

    @property
    def model_name(self) -> str:
        return self.served_model_names[0]

    def request_exit(self, code: int) -> None:
        self.exit_code = code
        if self.uvicorn_server is not None:
            self.uvicorn_server.should_exit = True

    async def watch_engine(self) -> None:
        """Waits for the model to load, then for the engine to die (which it should not)."""
        ready = asyncio.ensure_future(self.engine.ready.wait())
        failed = asyncio.ensure_future(self.engine.failed.wait())
        await asyncio.wait({ready, failed}, return_when=asyncio.FIRST_COMPLETED)
        if self.engine.failed.is_set():
            ready.cancel()
            logger.error("error: %s", self.engine.error)
            self.request_exit(2)
            return
        info = self.engine.info
        from tokenizers import Tokenizer

        self.tokenizer = WhisperTokenizer(Tokenizer.from_str(info.tokenizer_json), info.vocab_size, verify=False)
        logger.info(
            "ready: %s (%s) on %s, %s; KV pool %d blocks of %d tokens",
            info.model_name, info.model_source, info.device, info.dtype, info.num_kv_blocks, info.block_size,
        )
        await failed
        # Stay up for a moment answering /health with 503, so load balancers see it go.
        await asyncio.sleep(self.config.engine_death_grace_s)
        self.request_exit(1)


def build_app(config: ServerConfig, engine_config: EngineConfig) -> FastAPI:
    state = ServerState(config, engine_config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        watcher = asyncio.create_task(state.watch_engine())
        try:
            yield
        finally:
            watcher.cancel()
            state.pool.shutdown()
            await asyncio.to_thread(state.engine.shutdown)

    app = FastAPI(title="asrserve", version=__version__, lifespan=lifespan)
    app.state.asr = state
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
    _add_error_handlers(app)
    _add_routes(app, state)
    return app


def _add_routes(app: FastAPI, state: ServerState) -> None:
    @app.get("/health")
    async def health() -> Response:
        if state.engine.failed.is_set():
            return JSONResponse({"status": "error", "error": state.engine.error}, status_code=503)
        if state.shutting_down:  # draining: the load balancer should send new work elsewhere
            return JSONResponse({"status": "shutting down"}, status_code=503)
        if state.engine.is_ready and state.tokenizer is not None:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "loading"}, status_code=503)

    @app.get("/version")
    async def version() -> dict:
        return {"version": __version__}

    @app.get("/metrics")
    async def metrics() -> Response:
        state.metrics.preprocess_queue_depth.set(state.pool.num_queued)
        state.metrics.requests_waiting_http.set(state.num_waiting)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")

    @app.get("/v1/models")
    async def list_models(request: Request) -> dict:
        _authorize(request, state.api_key_digests)
        return {"object": "list", "data": [_model_card(name, state) for name in state.served_model_names]}

    @app.get("/v1/models/{model:path}")
    async def retrieve_model(model: str, request: Request) -> dict:
        _authorize(request, state.api_key_digests)
        _check_model_name(model, state)
        return _model_card(model, state)

    @app.post("/v1/audio/transcriptions")
    async def transcriptions(request: Request) -> Response:
        return await _audio_endpoint(request, state, "transcribe", "transcriptions")

    @app.post("/v1/audio/translations")
    async def translations(request: Request) -> Response:
        return await _audio_endpoint(request, state, "translate", "translations")


def _model_card(name: str, state: ServerState) -> dict:
    info = state.engine.info
    return {
        "id": name,
        "object": "model",
        "created": 0,
        "owned_by": "asrserve",
        "root": info.model_name if info else None,
        "ready": state.engine.is_ready,
    }


def _digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def _authorize(request: Request, api_key_digests: list[bytes]) -> None:
    if not api_key_digests:
        return
    scheme, _, token = request.headers.get("authorization", "").partition(" ")
    # Digests are compared, not keys: equal lengths, so the comparison takes the same time
    # whatever the token's length or how much of it matches. Every key is tried (no early
    # exit reveals which one matched).
    offered = _digest(token.strip())
    matched = False
    for digest in api_key_digests:
        matched |= hmac.compare_digest(offered, digest)
    if scheme.lower() != "bearer" or not matched:
        raise APIError(
            401, "missing or incorrect API key: send it as 'Authorization: Bearer <key>'",
            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
        )


def _check_model_name(model: str | None, state: ServerState) -> None:
    if model is not None and model not in state.served_model_names:
        raise APIError(
            404, f"the model {shown(model)} does not exist; this server serves {', '.join(state.served_model_names)}",
            param="model", code="model_not_found",
        )


def _check_ready(state: ServerState) -> None:
    if state.engine.failed.is_set():
        raise APIError(503, f"the engine is not running: {state.engine.error}", type="server_error", code="engine_dead")
    if state.shutting_down:
        raise _shutting_down_error()
    if not state.engine.is_ready or state.tokenizer is None:
        raise APIError(
            503, "the model is still loading; retry shortly", type="server_error", code="model_loading",
            headers={"Retry-After": "5"},
        )


async def _audio_endpoint(request: Request, state: ServerState, task: str, endpoint: str) -> Response:
    arrival = time.monotonic()
    config = state.config
    _authorize(request, state.api_key_digests)
    _check_ready(state)
    if state.num_waiting >= config.max_waiting_requests:
        raise APIError(
            429, f"the server is at capacity ({state.num_waiting} requests waiting); retry shortly",
            type="rate_limit_error", code="server_busy", headers={"Retry-After": "1"},
        )
    waiting = _WaitingSlot(state)
    try:
        try:
            form = await read_form(
                request, int(config.max_audio_filesize_mb * 1024 * 1024), config.upload_idle_timeout_s
            )
        except ClientGone:
            return Response(status_code=CLIENT_CLOSED_REQUEST)
        params = TranscriptionRequest.from_form(form.fields)
        _check_model_name(params.model, state)
        _check_format(params)
        try:
            language = check_language(state.tokenizer, state.model_name, params.language, task)
        except InvalidRequestError as error:
            raise APIError(400, str(error), param="language" if params.language else "model") from None
        job_params = _JobParams(language, task, params, endpoint, arrival)
        try:
            return await _until_disconnect(request, _transcribe(state, form.file, job_params, waiting))
        except asyncio.CancelledError:
            if not state.shutting_down:
                raise
            # uvicorn cancels what outlasts --graceful-shutdown-timeout-s: say so, in our shape.
            raise _shutting_down_error() from None
    finally:
        if not waiting.handed_off:
            waiting.release()


def _check_format(params: TranscriptionRequest) -> None:
    if params.stream and params.response_format in TIMESTAMPED_FORMATS:
        raise APIError(
            400, f"response_format {params.response_format!r} is not available with stream=true: streaming sends "
            "text deltas; use json or text, or stream=false", param="stream",
        )
    if "word" in params.timestamp_granularities and params.response_format != "verbose_json":
        raise APIError(
            400, "timestamp_granularities[]=word needs response_format=verbose_json", param="timestamp_granularities",
        )


class _JobParams:
    def __init__(self, language: str | None, task: str, params: TranscriptionRequest, endpoint: str, arrival: float):
        self.language = language
        self.task = task
        self.request = params
        self.endpoint = endpoint
        self.arrival = arrival
        self.timestamps = params.response_format in TIMESTAMPED_FORMATS
        self.words = "word" in params.timestamp_granularities
        decode_once = params.stream or not params.temperature_fallback
        self.sampling = SamplingParams.transcription(
            params.temperature, decode_once=decode_once, seed=params.seed, max_tokens=params.max_completion_tokens,
            timestamps=self.timestamps, word_timestamps=self.words,
        )


class _WaitingSlot:
    """Counts a request against --max-waiting-requests until its text starts (or it ends)."""

    def __init__(self, state: ServerState):
        self.state = state
        self.held = True
        self.handed_off = False  # a streaming response owns it now
        state.num_waiting += 1

    def release(self) -> None:
        if self.held:
            self.held = False
            self.state.num_waiting -= 1


async def _transcribe(state: ServerState, audio: bytearray, job_params: _JobParams, waiting: _WaitingSlot) -> Response:
    try:
        prepared = await state.pool.prepare(audio)
    except AudioTooLongError as error:
        raise APIError(400, str(error), param="file", code="audio_too_long") from None
    except AudioError as error:
        raise APIError(400, str(error), param="file", code="invalid_audio") from None
    del audio
    try:
        job = TranscriptionJob(
            state.engine, state.tokenizer, prepared, job_params.language, job_params.task, job_params.sampling,
            job_params.request.max_completion_tokens, job_params.request.prompt,
        )
    except EngineDeadError as error:
        raise _engine_dead(error) from None
    job.on_first_output = waiting.release
    if job_params.request.stream:
        waiting.handed_off = True  # the response releases it, however the stream ends

        def cleanup() -> None:
            job.abort()
            waiting.release()

        return _CleanupStreamingResponse(
            _sse_events(state, job, job_params),
            cleanup,
            media_type="text/event-stream",
            headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"},
        )
    try:
        text = await job.run()
    except EngineDeadError as error:
        raise _engine_dead(error) from None
    except InvalidRequestError as error:
        raise APIError(400, str(error)) from None
    finally:
        job.abort()
    _record_job(state, job, job_params)
    return _render(state, job, job_params, text)


def _render(state: ServerState, job: TranscriptionJob, job_params: _JobParams, text: str) -> Response:
    response_format = job_params.request.response_format
    if response_format == "text":
        return PlainTextResponse(text + "\n")
    if response_format == "json":
        return JSONResponse({"text": text, "usage": usage_duration(job.duration_s)})
    segments = build_segments(state.tokenizer, job.pieces, job.language, words=job_params.words)
    if response_format == "srt":
        return Response(to_srt(segments), media_type=CONTENT_TYPES["srt"])
    if response_format == "vtt":
        return Response(to_vtt(segments), media_type=CONTENT_TYPES["vtt"])
    return JSONResponse(
        to_verbose_json(job_params.task, job.language, job.duration_s, text, segments, job_params.words,
                        usage_duration(job.duration_s))
    )


class _CleanupStreamingResponse(StreamingResponse):
    """Runs `cleanup` when the response ends for any reason, even if the client left before
    the first byte and the event generator never started."""

    def __init__(self, content, cleanup: Callable[[], None], **kwargs):
        super().__init__(content, **kwargs)
        self.cleanup = cleanup

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.cleanup()


async def _sse_events(state: ServerState, job: TranscriptionJob, job_params: _JobParams) -> AsyncIterator[str]:
    try:
        async for delta in job.deltas():
            yield _sse({"type": "transcript.text.delta", "delta": delta})
        audio_tokens = len(job.requests) * 1500
        usage = {
            "type": "tokens",
            "input_tokens": audio_tokens,
            "input_token_details": {"audio_tokens": audio_tokens, "text_tokens": 0},
            "output_tokens": job.num_output_tokens,
            "total_tokens": audio_tokens + job.num_output_tokens,
        }
        yield _sse({"type": "transcript.text.done", "text": job.text, "usage": usage})
        yield "data: [DONE]\n\n"
        _record_job(state, job, job_params)
    except EngineDeadError as error:
        yield _sse(error_body(f"the engine stopped: {error}", "server_error", code="engine_dead"))
    except InvalidRequestError as error:
        yield _sse(error_body(str(error), "invalid_request_error"))
    finally:
        job.abort()


def _sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def _record_job(state: ServerState, job: TranscriptionJob, job_params: _JobParams) -> None:
    metrics, endpoint = state.metrics, job_params.endpoint
    metrics.audio_seconds.labels(endpoint).inc(job.duration_s)
    metrics.output_tokens.labels(endpoint).inc(job.num_output_tokens)
    if job.first_token_time is not None:
        metrics.time_to_first_token.labels(endpoint).observe(job.first_token_time - job_params.arrival)


def _shutting_down_error() -> APIError:
    return APIError(
        503, "the server is shutting down; retry on another replica", type="server_error", code="shutting_down",
        headers={"Retry-After": "1"},
    )


def _engine_dead(error: EngineDeadError) -> APIError:
    return APIError(503, f"the engine stopped: {error}", type="server_error", code="engine_dead")


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


# Errors ----------------------------------------------------------------------------------------


def _add_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        api = validation_error(error.errors())
        return JSONResponse(api.body(), status_code=400)

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        error_type = "invalid_request_error" if error.status_code < 500 else "server_error"
        body = error_body(str(error.detail), error_type, code=str(error.status_code))
        return JSONResponse(body, status_code=error.status_code, headers=getattr(error, "headers", None))

    @app.exception_handler(Exception)
    async def unexpected_error(request: Request, error: Exception) -> JSONResponse:
        logger.exception("internal error on %s %s", request.method, request.url.path)
        body = error_body("internal server error: this is a bug in asrserve; the log has the details", "server_error",
                          code="internal_error")
        return JSONResponse(body, status_code=500)


class MetricsMiddleware:
    """Counts requests by endpoint and status and times them to their last byte (pure ASGI, so
    streaming and disconnect detection pass through untouched)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = ENDPOINTS.get(path) or ("models" if path.startswith("/v1/models/") else "other")
        start = time.monotonic()
        status = [500]

        async def send_with_status(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            self.metrics.requests.labels(endpoint, str(status[0])).inc()
            if endpoint in ("transcriptions", "translations"):
                self.metrics.request_latency.labels(endpoint).observe(time.monotonic() - start)


class GracefulServer(uvicorn.Server):
    """uvicorn, less one habit: after a graceful shutdown on SIGTERM it raises the signal again,
    so the process would end "killed by SIGTERM". A drained, orderly stop is a success, and
    orchestrators and supervisors should see exit status 0."""

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            self._captured_signals.clear()


def run_server(config: ServerConfig, engine_config: EngineConfig) -> int:
    """Serves until interrupted; returns the process exit status."""
    app = build_app(config, engine_config)
    state: ServerState = app.state.asr
    server = GracefulServer(
        uvicorn.Config(
            app, host=config.host, port=config.port, log_level=config.log_level, access_log=config.access_log,
            timeout_keep_alive=30, timeout_graceful_shutdown=config.graceful_shutdown_timeout_s,
        )
    )
    state.uvicorn_server = server
    display_host = "localhost" if config.host in ("0.0.0.0", "::") else config.host
    logger.info(
        "asrserve %s serving %s at http://%s:%d (OpenAI base URL http://%s:%d/v1)",
        __version__, state.model_name, display_host, config.port, display_host, config.port,
    )
    server.run()
    if not server.started and state.exit_code == 0:
        return 1
    return state.exit_code
