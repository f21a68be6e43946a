"""The server's handle on the engine process: start it, submit requests, stream their outputs,
abort them, and notice when the process dies.

Two threads do the blocking pipe work so the event loop never waits on the engine: a sender
drains an outbox queue into the pipe, and a receiver hands each incoming message to the loop
with call_soon_threadsafe. The loop routes outputs to one asyncio queue per request."""

from __future__ import annotations

import asyncio
import logging
import multiprocessing
import queue
import threading
import time
from collections.abc import AsyncIterator, Callable

from asrserve.config import EngineConfig
from asrserve.engine.engine_process import EngineInfo, EngineRequest, EngineStats, run_engine
from asrserve.engine.request import RequestOutput

logger = logging.getLogger(__name__)

# The most audio one "add" message carries (32 pieces of 30 s): messages are pickled whole.
ADD_MESSAGE_BYTES = 32 * 30 * 16000 * 4


class EngineDeadError(RuntimeError):
    """The engine process exited; nothing submitted to it will finish."""


class RequestStream:
    """The outputs of one engine request, in order, ending with the finished one."""

    def __init__(self, request_id: str):
        self.request_id = request_id
        self.finished = False
        self._queue: asyncio.Queue[RequestOutput | BaseException] = asyncio.Queue()

    def put(self, item: RequestOutput | BaseException) -> None:
        self._queue.put_nowait(item)

    async def __aiter__(self) -> AsyncIterator[RequestOutput]:
        while not self.finished:
            item = await self._queue.get()
            if isinstance(item, BaseException):
                self.finished = True
                raise item
            self.finished = item.finished
            yield item


class AsyncEngineClient:
    def __init__(self, config: EngineConfig, log_level: int = logging.INFO):
        self.config = config
        self.log_level = log_level
        self.info: EngineInfo | None = None
        self.stats: EngineStats | None = None
        self.error: str | None = None  # why the engine failed to start or died
        self.ready = asyncio.Event()
        self.failed = asyncio.Event()  # set once the engine fails to start or dies
        self.on_stats: Callable[[EngineStats], None] | None = None
        self.on_abort: Callable[[int], None] | None = None  # called with how many were aborted
        self._streams: dict[str, RequestStream] = {}
        self.num_added = 0  # requests ever added: the server's idle watch reads it
        self._last_progress = time.monotonic()  # the engine's last message, or work arriving when it had none
        self._outbox: queue.SimpleQueue = queue.SimpleQueue()
        self._process: multiprocessing.Process | None = None
        self._stopping = False
        # multiprocessing's Process is not thread-safe: when the receiver thread (engine died)
        # and shutdown() both wait for the exit, one thread's waitpid reaps the process and the
        # other's fails with ECHILD, which Process reads as "still running" (it then reported a
        # clean exit as "did not stop within 5 s"). Every wait for the process takes this lock.
        self._join_lock = threading.Lock()

    @property
    def is_ready(self) -> bool:
        return self.ready.is_set() and not self.failed.is_set()

    @property
    def seconds_without_progress(self) -> float:
        """How long the engine has held requests without a word: it reports after every step
        while it has work, so a long silence is a hung step (a deadlock, a GPU that stopped
        answering, a process stopped), not load."""
        return time.monotonic() - self._last_progress if self._streams else 0.0

    @property
    def pid(self) -> int | None:
        return self._process.pid if self._process else None

    def start(self) -> None:
        """Starts the engine process; `ready` or `failed` is set once the model has loaded or not."""
        context = multiprocessing.get_context("spawn")  # CUDA and threads rule out fork
        to_engine_read, to_engine_write = context.Pipe(duplex=False)
        from_engine_read, from_engine_write = context.Pipe(duplex=False)
        self._process = context.Process(
            target=run_engine,
            args=(self.config, to_engine_read, from_engine_write, self.log_level),
            name="asrserve-engine",
            daemon=True,
        )
        self._process.start()
        # Close our copies of the child's ends: when the child dies its pipe end closes and
        # the receiver sees EOF at once.
        to_engine_read.close()
        from_engine_write.close()
        loop = asyncio.get_running_loop()
        threading.Thread(
            target=self._send_loop, args=(to_engine_write, loop), name="engine-sender", daemon=True
        ).start()
        threading.Thread(
            target=self._receive_loop, args=(from_engine_read, loop), name="engine-receiver", daemon=True
        ).start()

    def add(self, requests: list[EngineRequest]) -> list[RequestStream]:
        """Submits requests together, so the engine can encode them in one forward: in one
        message, or in several of at most ADD_MESSAGE_BYTES of audio (an hour's 127 pieces in
        one message were 230 MB pickled at once here, and again unpickled there)."""
        if not self.is_ready:
            raise EngineDeadError(self.error or "the engine is not ready")
        streams = []
        if not self._streams:
            self._last_progress = time.monotonic()
        for request in requests:
            assert request.request_id not in self._streams, request.request_id
            stream = self._streams[request.request_id] = RequestStream(request.request_id)
            streams.append(stream)
        self.num_added += len(requests)
        message: list[EngineRequest] = []
        size = 0
        for request in requests:
            if message and size + request.audio.nbytes > ADD_MESSAGE_BYTES:
                self._outbox.put(("add", message))
                message, size = [], 0
            message.append(request)
            size += request.audio.nbytes
        self._outbox.put(("add", message))
        return streams

    def abort(self, request_ids: list[str], counted: bool = True) -> None:
        """Stops the requests and frees their blocks; their streams end at once. counted: for
        on_abort (a live session's decodes are superseded as a matter of course)."""
        ids = [request_id for request_id in request_ids if request_id in self._streams]
        if not ids:
            return
        for request_id in ids:
            self._streams.pop(request_id).put(RequestOutput(request_id, [], [], True, "abort"))
        if self.on_abort is not None and counted:
            self.on_abort(len(ids))
        if not self.failed.is_set():
            self._outbox.put(("abort", ids))

    @property
    def num_unfinished(self) -> int:
        return len(self._streams)

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopping = True
        if self._process is None:
            return
        self._outbox.put(("shutdown",))
        self._outbox.put(None)  # stops the sender thread
        with self._join_lock:
            loading = not self.ready.is_set()
            if loading:  # nothing to finish, and it reads no message until it has loaded
                self._process.kill()
            self._process.join(timeout)
            if self._process.is_alive():
                logger.warning("the engine process did not stop within %.0f s; killing it", timeout)
                self._process.kill()
                self._process.join()
            elif self._process.exitcode != 0 and not loading:
                logger.warning("the engine process exited with code %s", self._process.exitcode)

    # Threads ---------------------------------------------------------------------------------

    def _send_loop(self, connection, loop: asyncio.AbstractEventLoop) -> None:
        while (message := self._outbox.get()) is not None:
            try:
                connection.send(message)  # pickled whole before a byte is written
            except (OSError, EOFError):
                return  # the receiver reports the death
            except Exception as error:  # a message that cannot be pickled: its requests fail, the thread goes on
                logger.exception("could not send a %r message to the engine", message[0])
                if message[0] == "add":
                    failed = [RequestOutput(request.request_id, [], [], True, "error", bug=True,
                                            error=f"could not send the request to the engine: {error}")
                              for request in message[1]]
                    try:
                        loop.call_soon_threadsafe(self._dispatch, ("outputs", failed, self.stats))
                    except RuntimeError:  # the loop has closed: the server is gone
                        return
            # Not held while waiting for the next: an "add" carries up to ADD_MESSAGE_BYTES of audio.
            message = None
        connection.close()

    def _receive_loop(self, connection, loop: asyncio.AbstractEventLoop) -> None:
        while True:
            try:
                message = connection.recv()
            except (EOFError, OSError):
                break
            except Exception as error:  # an unreadable message (MemoryError, say): its requests would wait forever
                logger.exception("could not read the engine's output")
                self.error = f"could not read the engine's output ({error!r}); the engine was stopped"
                self._process.kill()
                break
            try:
                loop.call_soon_threadsafe(self._dispatch, message)
            except RuntimeError:  # the loop has closed: the server is gone
                return
        with self._join_lock:
            self._process.join(timeout=5)  # so that _on_engine_exit can report the exit code
        try:
            loop.call_soon_threadsafe(self._on_engine_exit)
        except RuntimeError:
            pass

    # Event loop ------------------------------------------------------------------------------

    def _dispatch(self, message: tuple) -> None:
        kind = message[0]
        if kind == "outputs":
            _, outputs, stats = message
            self._last_progress = time.monotonic()
            for output in outputs:
                stream = self._streams.get(output.request_id)
                if stream is None:
                    continue  # aborted here already
                stream.put(output)
                if output.finished:
                    del self._streams[output.request_id]
            self.stats = stats
            if self.on_stats is not None:
                self.on_stats(stats)
        elif kind == "ready":
            self.info = message[1]
            self.ready.set()
        elif kind == "failed":
            self.error = message[1]
            self.failed.set()
        else:
            raise AssertionError(f"unknown engine message {kind!r}")

    def _on_engine_exit(self) -> None:
        if self._stopping:
            return
        code = self._process.exitcode
        if self.error is None:
            self.error = f"the engine process exited unexpectedly (exit code {code})"
        if not self.failed.is_set():  # a start-up failure was reported with its message already
            logger.error("%s", self.error)
        self.failed.set()
        for stream in self._streams.values():
            stream.put(EngineDeadError(self.error))
        self._streams.clear()
