"""OpenAI's Realtime API for transcription: WS /v1/realtime?intent=transcription.

The connection: authorize (the `Authorization: Bearer` header, or the
`openai-insecure-api-key.<key>` subprotocol browsers send) → check the model and the session
limit → session.created → client events in order, each answered or refused with an `error`
event that names it (the session goes on). A client that sends nothing for
--realtime-idle-timeout-s is told so and disconnected; a disconnect aborts the session's engine
work. Decodes are ordinary engine requests marked interactive (served ahead of file work)."""

from __future__ import annotations

import asyncio
import logging
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any
from urllib.parse import urlsplit

from fastapi import FastAPI, WebSocket, WebSocketDisconnect
from fastapi.responses import JSONResponse

from asrserve.engine.request_checks import check_language
from asrserve.entrypoints.auth import authorize, is_allowed_key
from asrserve.entrypoints.live_shutdown import (
    CLOSE_SERVICE_RESTART, SHUTDOWN_REASON, LiveConnection, drain_sessions, shutting_down,
)
from asrserve.entrypoints.live_socket import SendTimeout, send_event, within
from asrserve.entrypoints.protocol import APIError
from asrserve.entrypoints.realtime_client_events import (
    BETA_SESSION_UPDATE, SESSION_UPDATES, in_beta_terms, parse_event, session_of,
)
from asrserve.entrypoints.realtime_protocol import RealtimeError, SessionConfig, new_id, server_event
from asrserve.entrypoints.realtime_session import RealtimeOptions, RealtimeSession
from asrserve.entrypoints.server_state import ServerState
from asrserve.entrypoints.serving_models import check_model_name
from asrserve.errors import InvalidRequestError, shown
from asrserve.worker.cpu_quota import usable_cpus

logger = logging.getLogger("asrserve.realtime")

KEY_SUBPROTOCOL = "openai-insecure-api-key."
CLOSE_TRY_AGAIN_LATER = 1013  # RFC 6455: the server is overloaded
CLOSE_POLICY = 1008


class RealtimeState:
    """What the realtime routes share: the live sessions and the live VAD's thread."""

    def __init__(self, state: ServerState):
        config = state.config
        interim_slots = config.realtime_max_interim_decodes
        if interim_slots is None:
            interim_slots = max(1, usable_cpus() // 2)
        self.options = RealtimeOptions(
            interim_interval_s=config.realtime_interim_interval_s, max_buffer_s=config.realtime_max_buffer_s,
            pause_ms=config.realtime_pause_ms,
            interim_slots=asyncio.Semaphore(interim_slots),
        )
        self.num_sessions = 0
        self.sessions: set[LiveConnection] = set()  # open now: drained when the server stops
        self.draining = False
        # One thread runs every session's VAD in order: appends are small and frequent, and a
        # long upload in the preprocessing pool must not hold up a live turn's end.
        self._vad_thread = ThreadPoolExecutor(max_workers=1, thread_name_prefix="realtime-vad")
        # Now, not in the first live session's first turn; its outcome holds for every session.
        self._vad_loaded = self._vad_thread.submit(_load_vad)

    async def vad_error(self) -> str | None:
        """Why live sessions cannot use server VAD here (None: they can), once it has loaded."""
        return await asyncio.wrap_future(self._vad_loaded)

    async def run_vad(self, function, *args):
        return await asyncio.get_running_loop().run_in_executor(self._vad_thread, function, *args)

    async def drain(self, timeout_s: float) -> None:
        """The server stops: live sessions end (entrypoints.live_shutdown); none starts meanwhile."""
        self.draining = True
        await drain_sessions(list(self.sessions), timeout_s)

    def shutdown(self) -> None:
        self._vad_thread.shutdown(wait=False, cancel_futures=True)


def _load_vad() -> str | None:
    """Loads the process's VAD; returns why it cannot be loaded, or None."""
    from asrserve.audio.vad import get_vad

    try:
        get_vad()
    except ImportError as error:  # vad.VADUnavailableError
        logger.warning(
            "Silero VAD is unavailable: %s. Uploads over 30 s cut at voice activity (the default chunking) "
            "get a 500 (vad_unavailable), and live sessions start without server_vad turn detection", error,
        )
        return str(error)
    return None


def _vad_unavailable(reason: str) -> RealtimeError:
    return RealtimeError(
        f"server_vad turn detection is unavailable on this server ({reason}): turn_detection is null, so "
        "send input_audio_buffer.commit to end each turn", param="session.audio.input.turn_detection",
        code="vad_unavailable", type="server_error",
    )


def add_realtime_routes(app: FastAPI, state: ServerState) -> RealtimeState:
    realtime = RealtimeState(state)

    @app.websocket("/v1/realtime")
    async def realtime_endpoint(websocket: WebSocket) -> None:
        try:
            _check_origin(websocket, state)
            subprotocol = _authorize(websocket, state)
            _check_query(websocket, state)
            state.check_ready()
        except APIError as error:
            state.metrics.realtime_refused.labels(error.code or str(error.status_code)).inc()
            await _deny(websocket, error)
            return
        await websocket.accept(subprotocol=subprotocol)
        if realtime.num_sessions >= state.config.realtime_max_sessions:
            state.metrics.realtime_refused.labels("session_limit_reached").inc()
            try:  # (within the idle timeout, as a session's own sends)
                await send_event(websocket, RealtimeError(
                    f"this server holds {state.config.realtime_max_sessions} live sessions at most; retry shortly",
                    type="server_error", code="session_limit_reached",
                ).event(None), state.config.realtime_idle_timeout_s)
                await within(websocket, websocket.close(CLOSE_TRY_AGAIN_LATER, "too many sessions"),
                             state.config.realtime_idle_timeout_s)
            except SendTimeout:
                pass
            return
        realtime.num_sessions += 1
        state.metrics.realtime_sessions.inc()
        state.metrics.realtime_opened.inc()
        try:
            await _run_session(websocket, state, realtime)
        finally:
            realtime.num_sessions -= 1
            state.metrics.realtime_sessions.dec()

    return realtime


def _check_origin(websocket: WebSocket, state: ServerState) -> None:
    """A browser page may open a session only from the server's own origin (the playground) or
    one of --allowed-origins, as CORS rules its HTTP calls: browsers apply no CORS to
    WebSockets, so any page could otherwise hold live sessions and read their transcripts.
    Clients that are not browsers send no Origin."""
    origin = websocket.headers.get("origin")
    allowed = state.config.allowed_origins
    if origin is None or "*" in allowed or origin in allowed:
        return
    if urlsplit(origin).netloc == websocket.headers.get("host"):
        return
    raise APIError(403, f"pages of {origin} may not open live sessions: start the server with "
                   "--allowed-origins to allow them", type="invalid_request_error", code="origin_not_allowed")


def _authorize(websocket: WebSocket, state: ServerState) -> str | None:
    """Raises 401 unless a key is allowed; returns the subprotocol to accept."""
    offered = [p.strip() for p in websocket.headers.get("sec-websocket-protocol", "").split(",") if p.strip()]
    keys = [p[len(KEY_SUBPROTOCOL):] for p in offered if p.startswith(KEY_SUBPROTOCOL)]
    if not (keys and state.api_key_digests and any(is_allowed_key(key, state.api_key_digests) for key in keys)):
        authorize(websocket.headers, state.api_key_digests)
    # The browser demands that one offered subprotocol comes back; never echo the key.
    return next((p for p in offered if not p.startswith(KEY_SUBPROTOCOL)), None)


def _check_query(websocket: WebSocket, state: ServerState) -> None:
    intent = websocket.query_params.get("intent")
    if intent is not None and intent != "transcription":
        raise APIError(400, f"intent {shown(intent)} is not available: this server runs transcription sessions "
                       "(?intent=transcription)", param="intent")
    check_model_name(websocket.query_params.get("model"), state)


async def _deny(websocket: WebSocket, error: APIError) -> None:
    """Refuses the handshake with an HTTP response in OpenAI's error shape (where the server
    supports it), else closes it."""
    try:
        await websocket.send_denial_response(
            JSONResponse(error.body(), status_code=error.status_code, headers=error.headers)
        )
    except RuntimeError:
        await websocket.close(CLOSE_POLICY, error.message[:120])


async def _run_session(websocket: WebSocket, state: ServerState, realtime: RealtimeState) -> None:
    send_lock, closed = asyncio.Lock(), False
    idle_timeout = state.config.realtime_idle_timeout_s

    async def send(event: dict[str, Any]) -> None:
        nonlocal closed
        if closed:
            return
        async with send_lock:
            try:
                # A client that has not read for the idle timeout is gone as much as one that
                # sends nothing (its unread events fill the buffers; the send waits for room).
                await send_event(websocket, event, idle_timeout)
            except SendTimeout:  # dropped: the receive loop sees the disconnect and ends the session
                closed = True
                logger.info("realtime session %s: the client read nothing for %g s; dropped", session_id, idle_timeout)
            except (WebSocketDisconnect, RuntimeError, OSError):
                closed = True  # the receive loop sees the disconnect and ends the session
            if closed:  # its decodes stop now: an event may be handled for a while yet (its turns)
                session.close()

    async def close(code: int, reason: str) -> None:
        nonlocal closed
        async with send_lock:
            if closed:
                return
            closed = True
            try:
                await within(websocket, websocket.close(code, reason), idle_timeout)  # as a send
            except (SendTimeout, RuntimeError, OSError):
                pass

    session_id = new_id("sess")
    # Without the VAD a session still works, with manual commits: it says so, and refuses
    # session.updates that ask for server_vad.
    vad_error = await realtime.vad_error()
    config = SessionConfig(model=websocket.query_params.get("model") or state.model_name,
                           **({"turn_detection": None} if vad_error is not None else {}))
    session = RealtimeSession(session_id, config, realtime.options, state.engine, state.tokenizer, send,
                              realtime.run_vad, state.metrics)
    await send(server_event("session.created", session=config.as_session(session_id)))
    if vad_error is not None:
        await send(_vad_unavailable(vad_error).event(None))
    connection = LiveConnection(session, send, close)
    realtime.sessions.add(connection)
    try:
        if realtime.draining:  # it opened as the server began to stop
            await send(shutting_down().event(None))
            await close(CLOSE_SERVICE_RESTART, SHUTDOWN_REASON)
            return
        last_event = time.monotonic()
        while True:
            try:
                message = await asyncio.wait_for(websocket.receive(), session.tasks.idle_wait_s(last_event, idle_timeout))
            except asyncio.TimeoutError:
                if session.tasks.idle_wait_s(last_event, idle_timeout) > 0:  # transcribing, or not long since
                    continue
                # The turn being spoken when the client went quiet (a stalled microphone) is
                # committed and transcribed first, as at shutdown: its deltas may have gone out.
                async with connection.handling:
                    await session.finish()
                notice = f"no event for {idle_timeout:g} s: the session is closed (its open turn transcribed first)"
                await send(RealtimeError(notice, code="idle_timeout").event(None))
                await close(1000, "idle timeout")
                return
            if message["type"] == "websocket.disconnect":
                return
            last_event, event, event_id = time.monotonic(), {}, None
            try:
                event, event_id = parse_event(message)
                await session.tasks.room()  # (backpressure: the client's events wait in its socket)
                if realtime.draining:  # (also where it began while this event waited for room)
                    if event.get("type") == "input_audio_buffer.append":
                        continue  # audio after the turn the shutdown ended
                    raise shutting_down()
                if event.get("type") in SESSION_UPDATES:
                    update = session_of(event)
                    _check_session(update, state)
                    if vad_error is not None and session.config.updated(update).turn_detection:
                        raise _vad_unavailable(vad_error)
                async with connection.handling:
                    await session.handle(event)
            except RealtimeError as error:
                error = in_beta_terms(error) if event.get("type") == BETA_SESSION_UPDATE else error
                await send(error.event(event_id or error.event_id))
            except Exception:  # a bug: this event fails, the session goes on
                logger.exception("realtime session %s: the event failed", session_id)
                await send(RealtimeError("the server failed on this event: this is a bug in asrserve; the log has "
                                         "the details", code="server_error", type="server_error").event(event_id))
    except WebSocketDisconnect:
        return
    finally:
        realtime.sessions.discard(connection)
        closed = True
        session.close()


def _check_session(session: Any, state: ServerState) -> None:
    """The model and language a session update names, by the rules of the HTTP API."""
    transcription = _field(session, "audio", "input", "transcription")
    param = "session.audio.input.transcription"
    model, language = _field(transcription, "model"), _field(transcription, "language")
    if isinstance(model, str):
        try:
            check_model_name(model, state)
        except APIError as error:
            raise RealtimeError(error.message, param=f"{param}.model", code="model_not_found") from None
    languages = _field(transcription, "languages")
    listed = languages if isinstance(languages, list) else []  # (anything else is refused by the protocol's rules)
    for name, code in [("language", language), *(("languages", code) for code in listed)]:
        if isinstance(code, str) and code:
            try:
                check_language(state.tokenizer, state.model_name, code, "transcribe")
            except InvalidRequestError as error:
                raise RealtimeError(str(error), param=f"{param}.{name}") from None


def _field(value: Any, *path: str) -> Any:
    for name in path:
        value = value.get(name) if isinstance(value, dict) else None
    return value
