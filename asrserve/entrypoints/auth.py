"""Bearer API keys for /v1/*: the same rule for every API (HTTP, and the live WebSocket)."""

from __future__ import annotations

import hashlib
import hmac
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
