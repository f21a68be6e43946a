"""How live sessions end when the server stops (SIGTERM). uvicorn drains HTTP requests but
closes WebSockets at once, 1012 without a word, and the turn being spoken is lost. Instead each
session is told (an `error` event, code `shutting_down`), takes no more events, has its open
turn committed and transcribed, and closes with 1012 and a reason, within the grace period."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from asrserve.entrypoints.realtime_protocol import RealtimeError

if TYPE_CHECKING:
    from asrserve.entrypoints.realtime_session import RealtimeSession

CLOSE_SERVICE_RESTART = 1012  # RFC 6455: the server is restarting (uvicorn's own, without a reason)
SHUTDOWN_REASON = "the server is shutting down"
CLOSE_WAIT_S = 1.0  # at least this long for the sessions' last events and closes, whatever is left


def shutting_down() -> RealtimeError:
    return RealtimeError("the server is shutting down: this session takes no more events and closes once its "
                         "committed audio is transcribed; reconnect to another replica", type="server_error",
                         code="shutting_down")


class LiveConnection:
    """A session and its WebSocket, as the server's shutdown sees them."""

    def __init__(self, session: RealtimeSession, send, close):
        self.session = session
        self.send = send
        self.close = close  # (code, reason): closes the socket, once
        self.handling = asyncio.Lock()  # one client event at a time, and the shutdown's commit after it

    async def end(self) -> None:
        await self.send(shutting_down().event(None))
        async with self.handling:
            await self.session.finish()


async def drain_sessions(connections: list[LiveConnection], timeout_s: float) -> None:
    """Ends every session within timeout_s: past it their decodes stop and their committed
    turns get `failed`. Then each socket closes (1012). A client that reads nothing cannot hold
    this up: a send or close still stuck CLOSE_WAIT_S later is left to uvicorn's shutdown."""
    if not connections:
        return
    clock = asyncio.get_running_loop()
    deadline = clock.time() + timeout_s
    ending = {asyncio.ensure_future(connection.end()): connection for connection in connections}
    _, late = await asyncio.wait(ending, timeout=timeout_s)
    failing = []
    for task in late:
        task.cancel()
        failing += ending[task].session.close()
    if failing:  # their `failed` events go out before the close
        await asyncio.wait(failing, timeout=CLOSE_WAIT_S)
    closes = [asyncio.ensure_future(connection.close(CLOSE_SERVICE_RESTART, SHUTDOWN_REASON))
              for connection in connections]
    _, stuck = await asyncio.wait(closes, timeout=max(CLOSE_WAIT_S, deadline - clock.time()))
    for task in stuck:
        task.cancel()
