"""A live client's WebSocket, written to within a time limit: a client that reads nothing fills
the buffers between it and the server, and a send (or a close, which flushes first) then
waits for room for ever, holding the session and its slot under --realtime-max-sessions. Past
the limit the connection is dropped."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Awaitable
from typing import Any

from starlette.websockets import WebSocket

from asrserve.entrypoints.middleware import RAW_SEND_SCOPE_KEY

logger = logging.getLogger("asrserve.server")

try:  # Python 3.11: a deadline on the await itself, with no task of its own, so a send that does not
    from asyncio import timeout as _deadline  # wait (the usual case) yields to no other task
except ImportError:  # Python 3.10
    _deadline = None


class SendTimeout(Exception):
    """The client read nothing for the time limit: its connection was dropped."""


async def within(websocket: WebSocket, work: Awaitable[None], timeout_s: float) -> None:
    """Awaits a send or close on `websocket`; past timeout_s drops the connection and raises
    SendTimeout. (asyncio.wait_for would run it as a task: one more yield per event, where the
    shutdown's cancellation could land between a turn's `committed` and its completion.)"""
    try:
        if _deadline is None:
            await asyncio.wait_for(work, timeout_s)
        else:
            async with _deadline(timeout_s):
                await work
    except asyncio.TimeoutError:  # (TimeoutError itself from 3.11 on)
        abort(websocket)
        raise SendTimeout() from None


async def send_event(websocket: WebSocket, event: dict[str, Any], timeout_s: float) -> None:
    await within(websocket, websocket.send_text(json.dumps(event, ensure_ascii=False)), timeout_s)


def abort(websocket: WebSocket) -> None:
    """Drops the connection without a closing handshake. The transport is uvicorn's protocol's,
    the owner of the server's own ASGI send (Starlette wraps the one the endpoint sees)."""
    transport = getattr(getattr(websocket.scope.get(RAW_SEND_SCOPE_KEY), "__self__", None), "transport", None)
    if transport is None:
        logger.warning("realtime: no transport to drop the connection of a client that reads nothing")
    else:
        transport.abort()
