"""Bearer API keys for /v1/*: the same rule for every API (HTTP, and the live WebSocket)."""

from __future__ import annotations

import hashlib
import hmac
import logging
from collections.abc import Mapping

from asrserve.entrypoints.protocol import APIError


def api_key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode()).digest()


def is_allowed_key(token: str, api_key_digests: list[bytes]) -> bool:
    """Digests are compared, not keys: equal lengths, so the comparison takes the same time
    whatever the token's length or how much of it matches. Every key is tried (no early exit
    reveals which one matched)."""
    offered = api_key_digest(token.strip())
    matched = False
    for digest in api_key_digests:
        matched |= hmac.compare_digest(offered, digest)
    return matched


def authorize(headers: Mapping[str, str], api_key_digests: list[bytes]) -> None:
    """Raises 401 unless `Authorization: Bearer <key>` names one of the keys (or none is set).
    `headers`: an HTTP request's or a WebSocket's."""
    if not api_key_digests:
        return
    scheme, _, token = headers.get("authorization", "").partition(" ")
    if scheme.lower() != "bearer" or not is_allowed_key(token, api_key_digests):
        raise APIError(
            401, "missing or incorrect API key: send it as 'Authorization: Bearer <key>'",
            code="invalid_api_key", headers={"WWW-Authenticate": "Bearer"},
        )


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


def redact_keys_in_logs() -> None:
    """After uvicorn has configured logging (its WebSocket protocol logs through uvicorn.error):
    keys redacted, and a refused handshake not logged as a server error."""
    for name in ("uvicorn.error", "websockets.server", "websockets.client"):
        logger = logging.getLogger(name)
        for kind in (_RedactKeys, _RefusedHandshakes):
            if not any(isinstance(f, kind) for f in logger.filters):
                logger.addFilter(kind())
