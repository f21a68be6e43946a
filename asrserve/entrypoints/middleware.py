"""Request counts and latency by endpoint, measured around every HTTP request, each
request's id (X-Request-Id), and paths served with or without a trailing slash."""

from __future__ import annotations

import logging
import re
import time
import uuid

from asrserve.entrypoints.metrics import ServerMetrics

CLIENT_CLOSED_REQUEST = 499  # nginx's code for "the client left first"; logged, never sent
# Set in the ASGI scope by a response the client left mid-body (its status went out as 200).
CLIENT_CLOSED_SCOPE_KEY = "asrserve.client_closed"
# Set by a stream that ended on an error event: the status a request not streamed would have got.
STREAM_FAILED_SCOPE_KEY = "asrserve.stream_failed_status"
# A WebSocket's ASGI send as the server gave it (live_socket.abort reaches the transport through it).
RAW_SEND_SCOPE_KEY = "asrserve.raw_send"

ENDPOINTS = {
    "/v1/audio/transcriptions": "transcriptions",
    "/v1/audio/translations": "translations",
    "/v1/models": "models",
    "/health": "health",
    "/version": "version",
    "/metrics": "metrics",
}


# A client's or load balancer's own id is kept when it looks like one (it follows the request
# across hops); anything else is replaced, so no header value reaches a log or a response raw.
_FORWARDED_ID = re.compile(rb"[\w.:@/+=-]{1,128}")


def request_id(scope) -> str:
    """The request's id, as OpenAI's SDKs read it (their `request_id`): the X-Request-Id the
    client sent where it is plausible, else a new one in OpenAI's form, req_<32 hex digits>."""
    for name, value in scope.get("headers", ()):
        if name == b"x-request-id" and _FORWARDED_ID.fullmatch(value):
            return value.decode()
    return f"req_{uuid.uuid4().hex}"


class MetricsMiddleware:
    """Counts requests by endpoint and status and times them to their last byte (pure ASGI, so
    streaming and disconnect detection pass through untouched)."""

    def __init__(self, app, metrics: ServerMetrics):
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            if scope["type"] == "websocket":
                scope[RAW_SEND_SCOPE_KEY] = send  # (the middlewares outside this one pass it on as is)
            await self.app(scope, receive, send)
            return
        path = scope["path"]
        endpoint = ENDPOINTS.get(path) or ("models" if path.startswith("/v1/models/") else "other")
        start = time.monotonic()
        status = [None]
        rid = request_id(scope)
        scope.setdefault("state", {})["request_id"] = rid  # request.state.request_id

        async def send_with_status(message) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
                message = {**message, "headers": [*message.get("headers", ()), (b"x-request-id", rid.encode())]}
            await send(message)

        try:
            await self.app(scope, receive, send_with_status)
        finally:
            closed, failed = scope.get(CLIENT_CLOSED_SCOPE_KEY), scope.get(STREAM_FAILED_SCOPE_KEY)
            code = CLIENT_CLOSED_REQUEST if closed else failed or status[0] or 500
            self.metrics.requests.labels(endpoint, str(code)).inc()
            if code == CLIENT_CLOSED_REQUEST and status[0] in (None, CLIENT_CLOSED_REQUEST):
                # uvicorn logs a request as its response starts, and not to a client gone already
                # (a stream the client left mid-body was logged as 200, when it started)
                _log_access(scope, code)
            if endpoint in ("transcriptions", "translations") and code < 400:
                # answered requests only: refusals (401, 429) take a millisecond, and counted in,
                # they made the quantiles look better the more users were turned away
                self.metrics.request_latency.labels(endpoint).observe(time.monotonic() - start)


def _log_access(scope, code: int) -> None:
    """One access-log line as uvicorn writes them (its logger, its format; nothing where
    --no-access-log turned it off)."""
    client = scope.get("client")
    address = f"{client[0]}:{client[1]}" if client else "-"
    query = scope.get("query_string", b"").decode("latin-1")
    path = scope["path"] + (f"?{query}" if query else "")
    logging.getLogger("uvicorn.access").info(
        '%s - "%s %s HTTP/%s" %d', address, scope["method"], path, scope.get("http_version", "1.1"), code)


# What programs call (not the pages, whose relative links need their own redirect).
API_PATHS = ("/v1/", "/health/", "/version/", "/metrics/")


class TrailingSlashMiddleware:
    """Serves an API path with a trailing slash as the path without one (`/health/`,
    `/v1/audio/transcriptions/`, `/v1/realtime/`). Starlette would answer 307 to the other
    spelling instead: a client sends a whole upload twice (or, as curl, not again); a
    WebSocket cannot follow it and got 403; behind a TLS proxy whose address is not trusted
    for X-Forwarded-Proto the redirect points at http://; and `/v1/models/` read as a model
    named "" (404). The pages keep their redirects: /playground/ served as /playground would
    resolve its relative links under /playground/."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope, receive, send) -> None:
        path = scope.get("path", "")
        if scope["type"] in ("http", "websocket") and path.endswith("/") and path.startswith(API_PATHS):
            stripped = path.rstrip("/") or "/"
            raw = scope.get("raw_path")
            scope = {**scope, "path": stripped}
            if raw is not None:
                scope["raw_path"] = raw.rstrip(b"/") or b"/"
        await self.app(scope, receive, send)
