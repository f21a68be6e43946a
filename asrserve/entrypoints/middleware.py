"""Request counts and latency by endpoint, measured around every HTTP request."""

from __future__ import annotations

import time

from asrserve.entrypoints.metrics import ServerMetrics

CLIENT_CLOSED_REQUEST = 499  # nginx's code for "the client left first"; logged, never sent
# Set in the ASGI scope by a response the client left mid-body (its status went out as 200).
CLIENT_CLOSED_SCOPE_KEY = "asrserve.client_closed"

ENDPOINTS = {
    "/v1/audio/transcriptions": "transcriptions",
    "/v1/audio/translations": "translations",
    "/v1/models": "models",
    "/health": "health",
    "/version": "version",
    "/metrics": "metrics",
}


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
            code = CLIENT_CLOSED_REQUEST if scope.get(CLIENT_CLOSED_SCOPE_KEY) else status[0]
            self.metrics.requests.labels(endpoint, str(code)).inc()
            if endpoint in ("transcriptions", "translations"):
                self.metrics.request_latency.labels(endpoint).observe(time.monotonic() - start)
