"""The OpenAI-compatible HTTP server: the app factory and the process's life (start, ready,
drain on SIGTERM, exit when the engine dies). The event loop only parses, routes and streams:
uploads are decoded in the preprocessing pool and transcribed by the engine process.

Each API is a serving module that adds its routes to the app (serving_transcription,
serving_realtime, serving_models, serving_playground); a new API is one more module and one more line below."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import socket
import ssl
import sys
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import uvicorn
from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response

from asrserve import __version__
from asrserve.config import EngineConfig, ServerConfig
from asrserve.entrypoints.error_handlers import add_error_handlers, log_each_bug_once
from asrserve.entrypoints.log_filters import filter_server_logs
from asrserve.entrypoints.middleware import MetricsMiddleware, TrailingSlashMiddleware
from asrserve.entrypoints.realtime_client_events import MAX_EVENT_BYTES
from asrserve.entrypoints.server_state import ServerState
from asrserve.entrypoints.serving_models import add_models_routes
from asrserve.entrypoints.serving_playground import add_page_routes
from asrserve.entrypoints.serving_realtime import RealtimeState, add_realtime_routes
from asrserve.entrypoints.serving_transcription import add_transcription_routes

logger = logging.getLogger("asrserve.server")


def _exit_if_it_failed(watcher: asyncio.Task, state: ServerState) -> None:
    """A bug in the engine watcher (its tokenizer, say) would otherwise leave the server
    answering 503 "loading" for ever, its error in a task nobody reads."""
    if not watcher.cancelled() and watcher.exception() is not None:
        logger.error("the engine watcher failed", exc_info=watcher.exception())
        state.request_exit(1)


def build_app(config: ServerConfig, engine_config: EngineConfig) -> FastAPI:
    state = ServerState(config, engine_config)

    @asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        state.engine.start()
        watcher = asyncio.create_task(state.watch_engine())
        watcher.add_done_callback(lambda task: _exit_if_it_failed(task, state))
        releaser = asyncio.create_task(state.release_memory_when_idle())
        try:
            yield
        finally:
            watcher.cancel()
            releaser.cancel()
            state.pool.shutdown()
            realtime.shutdown()
            await asyncio.to_thread(state.engine.shutdown)

    app = FastAPI(title="asrserve", version=__version__, lifespan=lifespan)
    app.state.asr = state
    app.add_middleware(MetricsMiddleware, metrics=state.metrics)
    if config.allowed_origins:
        # Outermost: a browser's preflight (OPTIONS, no key yet) is answered here, before auth.
        app.add_middleware(
            CORSMiddleware, allow_origins=config.allowed_origins, allow_methods=["GET", "POST"],
            allow_headers=["*"], expose_headers=["Retry-After", "X-Request-Id"], max_age=600,
        )
    app.add_middleware(TrailingSlashMiddleware)  # outermost: every other layer sees the path it routes by
    add_error_handlers(app)
    _add_operations_routes(app, state)
    add_models_routes(app, state)
    add_transcription_routes(app, state)
    realtime = app.state.realtime = add_realtime_routes(app, state)
    add_page_routes(app, state)
    return app


def _add_operations_routes(app: FastAPI, state: ServerState) -> None:
    """What load balancers and Prometheus read; open without a key."""
    # HEAD too: some uptime monitors and load-balancer checks probe with it.
    @_get_and_head(app, "/health")
    async def health() -> Response:
        if state.engine.failed.is_set():
            return JSONResponse({"status": "error", "error": state.engine.error}, status_code=503)
        if state.shutting_down:  # draining: the load balancer should send new work elsewhere
            return JSONResponse({"status": "shutting down"}, status_code=503)
        stalled_s = state.engine.seconds_without_progress
        if 0 < state.config.engine_stall_timeout_s < stalled_s:  # hung: a liveness probe should restart us
            return JSONResponse({"status": "stalled", "error": f"the engine has not advanced for {stalled_s:.0f} s"},
                                status_code=503)
        if state.is_ready:
            return JSONResponse({"status": "ok"})
        return JSONResponse({"status": "loading"}, status_code=503)

    @_get_and_head(app, "/version")
    async def version() -> dict:
        return {"version": __version__}

    @_get_and_head(app, "/metrics")
    async def metrics() -> Response:
        state.metrics.preprocess_queue_depth.set(state.pool.num_queued)
        state.metrics.requests_waiting_http.set(state.num_waiting)
        state.metrics.audio_seconds_in_flight.set(state.audio_ms_in_flight / 1000)
        return Response(state.metrics.render(), media_type="text/plain; version=0.0.4; charset=utf-8")


def _get_and_head(app: FastAPI, path: str):
    """Registers an endpoint for GET and HEAD, HEAD out of the schema: one route with both
    methods gave two operations of one id, which FastAPI warns about on every first /docs."""
    def register(endpoint):
        app.add_api_route(path, endpoint, methods=["GET"])
        app.add_api_route(path, endpoint, methods=["HEAD"], include_in_schema=False)
        return endpoint

    return register


class GracefulServer(uvicorn.Server):
    """uvicorn, less two habits. After a graceful shutdown on SIGTERM it raises the signal
    again, so the process would end "killed by SIGTERM": a drained, orderly stop is a success,
    and orchestrators and supervisors should see exit status 0. And it drains HTTP requests
    but closes WebSockets at once (1012, without a word): live sessions drain too, first."""

    state: ServerState | None = None  # set by run_server
    realtime: RealtimeState | None = None

    @contextlib.contextmanager
    def capture_signals(self):
        with super().capture_signals():
            yield
            self._captured_signals.clear()

    async def shutdown(self, sockets=None) -> None:
        grace = self.config.timeout_graceful_shutdown
        if self.state is not None and self.state.engine.failed.is_set():
            # Nothing in flight can finish (an upload still arriving, say): exit now, so that
            # a supervisor restarts us, instead of after the whole grace period.
            self._limit_drain(0)
        elif self.realtime is not None and self.realtime.sessions:
            for server in self.servers:
                server.close()  # no new connections while the sessions end their turns
            began = time.monotonic()
            await self.realtime.drain(grace)
            remaining = grace - (time.monotonic() - began)
            self._limit_drain(0 if self.state.engine.failed.is_set() else max(0.0, remaining))
        await super().shutdown(sockets)

    def _limit_drain(self, seconds: float) -> None:
        """Shortens uvicorn's wait for HTTP requests. With none in flight the wait ends at once
        anyway, and a zero timeout would make uvicorn log "timeout graceful shutdown exceeded"
        for nothing (a model that failed to load; an engine death beside a load balancer's
        keep-alive connections)."""
        if self.server_state.tasks:  # (idle keep-alive connections uvicorn closes itself)
            self.config.timeout_graceful_shutdown = seconds


def _cannot_listen(host: str, port: int) -> str | None:
    """Why the server could not listen on host:port, found before the model loads (uvicorn
    binds after its start-up: seconds of loading, then exit 3)."""
    try:
        for family, kind, protocol, _, address in socket.getaddrinfo(host, port, type=socket.SOCK_STREAM):
            with socket.socket(family, kind, protocol) as probe:
                probe.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as asyncio's server does
                if family == socket.AF_INET6:  # and IPv6 only: `::` beside an IPv4 listener is fine
                    probe.setsockopt(socket.IPPROTO_IPV6, socket.IPV6_V6ONLY, 1)
                probe.bind(address)
    except OSError as error:
        shown = f"[{host}]" if ":" in host else host
        return f"cannot listen on {shown}:{port}: {error.strerror or error}"
    return None


def _cannot_serve_tls(certfile: str | None, keyfile: str | None) -> str | None:
    """Why the certificate and key cannot be served, found before the model loads (uvicorn
    would stop with a traceback; given an encrypted key, even one with an empty passphrase,
    OpenSSL would ask for it on the terminal and wait)."""
    if certfile is None:
        return None
    files = f"--ssl-certfile {certfile}" + ("" if keyfile is None else f" and --ssl-keyfile {keyfile}")
    asked = []

    def passphrase() -> bytes:
        asked.append(True)
        return b""

    try:
        ssl.create_default_context(ssl.Purpose.CLIENT_AUTH).load_cert_chain(certfile, keyfile, password=passphrase)
    except (OSError, ssl.SSLError) as error:
        if not asked:
            return f"cannot serve TLS with {files}: {getattr(error, 'strerror', None) or error}"
    if asked:
        return f"cannot serve TLS with {files}: the private key is encrypted (give it unencrypted)"
    return None


def run_server(config: ServerConfig, engine_config: EngineConfig) -> int:
    """Serves until interrupted; returns the process exit status."""
    reason = _cannot_listen(config.host, config.port) or _cannot_serve_tls(config.ssl_certfile, config.ssl_keyfile)
    if reason is not None:
        print(f"asrserve: error: {reason}", file=sys.stderr)
        return 2
    app = build_app(config, engine_config)
    state: ServerState = app.state.asr
    server = GracefulServer(uvicorn_config(app, config))
    filter_server_logs(config.access_log)  # uvicorn.Config has set logging up
    log_each_bug_once()
    state.uvicorn_server = server
    server.state, server.realtime = state, app.state.realtime
    url = served_url(config.host, config.port, tls=config.ssl_certfile is not None)
    logger.info("asrserve %s serving %s at %s (OpenAI base URL %s/v1)", __version__, state.model_name, url, url)
    server.run()
    if not server.started and state.exit_code == 0:
        return 1
    return state.exit_code


def uvicorn_config(app: FastAPI, config: ServerConfig) -> uvicorn.Config:
    return uvicorn.Config(
        app, host=config.host, port=config.port, log_level=config.log_level, access_log=config.access_log,
        timeout_keep_alive=config.keep_alive_timeout_s,
        timeout_graceful_shutdown=config.graceful_shutdown_timeout_s,
        # Above the largest realtime event we answer (15 MiB of audio in base64), so that an
        # append somewhat over it gets an `error` event rather than a dropped connection; not
        # far above, since each connection may hold a frame this large while it arrives.
        ws_max_size=MAX_EVENT_BYTES + (1 << 20),
        # Pings every 20 s keep proxies from closing a quiet session, but an unanswered one does
        # not close it: a session that waits for room for its turns (SessionTasks.room) reads
        # nothing, so the client's pong waits unread behind its audio, and on an overloaded
        # server uvicorn closed every such session with 1011 after 20 s, its committed turns
        # lost. A client that is gone is found by --realtime-idle-timeout-s, or by TCP.
        ws_ping_interval=20.0, ws_ping_timeout=None,
        ssl_certfile=config.ssl_certfile, ssl_keyfile=config.ssl_keyfile,
    )


def served_url(host: str, port: int, tls: bool = False) -> str:
    """The address the start-up log gives: localhost for every interface; an IPv6 address in
    brackets (http://::1:8000 is no URL)."""
    host = "localhost" if host in ("0.0.0.0", "::", "") else host
    scheme = "https" if tls else "http"
    return f"{scheme}://[{host}]:{port}" if ":" in host else f"{scheme}://{host}:{port}"
