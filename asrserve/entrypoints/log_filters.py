"""What the server's logs leave out: API keys, refusals a client caused logged as server
errors, and (without the access log) WebSocket handshakes."""

from __future__ import annotations

import logging


class _RedactKeys(logging.Filter):
    """Hides the headers that carry a key (Authorization, a browser's key subprotocol) from
    the WebSocket handshake's debug log, where the websockets library writes every header as
    "< name: value"."""

    SECRET_HEADERS = {"authorization", "sec-websocket-protocol"}

    def filter(self, record: logging.LogRecord) -> bool:
        args = record.args
        if isinstance(args, tuple) and len(args) == 2 and str(args[0]).lower() in self.SECRET_HEADERS:
            record.args = (args[0], "<redacted>")
        return True


class _RefusedHandshakes(logging.Filter):
    """uvicorn (0.54, its sans-I/O WebSocket protocol) logs "ASGI callable returned without
    completing handshake." at ERROR after every handshake refused with an HTTP response (a
    wrong key, model or origin), which the client caused and got its 4xx for: alerts on server
    errors would fire on each. asrserve's live endpoint always accepts, refuses or raises, so
    the line means a refusal."""

    def filter(self, record: logging.LogRecord) -> bool:
        return record.msg != "ASGI callable returned without completing handshake."


class _WebSocketAccessLines(logging.Filter):
    """uvicorn logs each WebSocket handshake ('... - "WebSocket /v1/realtime?..." [accepted]',
    or its status) and the websockets library "connection open" and "connection closed", all
    at INFO through uvicorn.error, whatever access_log says: with --no-access-log (for privacy,
    or quiet logs) a live session's path and client still showed."""

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.msg if isinstance(record.msg, str) else ""
        return not (message.startswith('%s - "WebSocket %s"') or message in ("connection open", "connection closed"))


def filter_server_logs(access_log: bool) -> None:
    """After uvicorn has configured logging (its WebSocket protocol logs through uvicorn.error):
    keys redacted, a refused handshake not logged as a server error, and without the access log
    no WebSocket handshake either."""
    kinds = [_RedactKeys, _RefusedHandshakes] + ([] if access_log else [_WebSocketAccessLines])
    for name in ("uvicorn.error", "websockets.server", "websockets.client"):
        logger = logging.getLogger(name)
        for kind in kinds:
            if not any(isinstance(f, kind) for f in logger.filters):
                logger.addFilter(kind())
