"""Audio work off the event loop: a bounded pool of threads decodes each upload, mixes it to
mono, resamples it to 16 kHz and cuts it into pieces of at most 30 s (at quiet points, or at
voice-activity boundaries with the process's one shared Silero model).

The pieces of a long upload come out while it is still being decoded (audio.piece_cutter), so
the engine starts on its first minutes while the pool reads the rest.

Jobs wait in the pool's queue in arrival order. A job whose client has left is cancelled
before it starts; one already running stops at its next block of audio."""

from __future__ import annotations

import asyncio
import os
import sys
import threading
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor

import numpy as np

from asrserve.audio.chunking import DEFAULT_CHUNKING, AudioPiece, ChunkingStrategy
from asrserve.audio.decode import load_audio
from asrserve.audio.piece_cutter import PieceCutter
from asrserve.audio.vad import VADUnavailableError
from asrserve.config import SAMPLE_RATE
from asrserve.entrypoints.error_handlers import vad_unavailable_error
from asrserve.worker.cpu_quota import usable_cpus


def default_preprocess_workers() -> int:
    return max(1, min(usable_cpus(), 2))


class PreparedAudio:
    """An upload's pieces, as they are cut. `pieces`: those known so far, in order; more()
    waits for the next ones and returns None once the audio is all read, `duration_s` set then.
    Audio given whole (offline, tests) is complete from the start."""

    def __init__(self, pieces: list[AudioPiece], duration_s: float | None, expected_s: float | None = None):
        self.pieces = list(pieces)
        self.duration_s = duration_s
        # For admission before the end is read: the header's duration (when exact), or what was
        # read so far.
        self.expected_s = duration_s if duration_s is not None else expected_s or 0.0
        self._queue: asyncio.Queue | None = None  # what the pool's thread sends, until complete
        self._cancelled = threading.Event()
        self._future: Future | None = None
        self.on_complete: Callable[[float], None] | None = None  # called with duration_s
        # Called with expected_s as reading passes it; what it raises ends the reading and comes
        # out of more() (the server's charge for audio in flight).
        self.on_read: Callable[[float], None] | None = None

    @property
    def complete(self) -> bool:
        return self.duration_s is not None

    async def more(self) -> list[AudioPiece] | None:
        """The next pieces, or None once every piece has come. Raises what decoding raised
        (AudioError for audio a user got wrong)."""
        if self.complete:
            return None
        item = await self._queue.get()
        if item is None:  # cancelled
            return None
        if isinstance(item, BaseException):
            self.cancel()
            raise item
        pieces, expected_s, duration_s = item
        self.pieces += pieces
        if expected_s > self.expected_s and duration_s is None and self.on_read is not None:
            try:
                self.on_read(expected_s)
            except Exception:
                self.cancel()
                raise
        self.expected_s = max(self.expected_s, expected_s)
        if duration_s is not None:
            self.duration_s = self.expected_s = duration_s
            if self.on_complete is not None:
                self.on_complete(duration_s)
        return pieces

    def cancel(self) -> None:
        """Stops the decoding (a queued job never starts); no more pieces come. Call on the
        event loop's thread."""
        if self._cancelled.is_set():
            return
        self._cancelled.set()
        if self._future is not None:
            self._future.cancel()
        if self._queue is not None and not self.complete:
            self._queue.put_nowait(None)


# The pool's threads run at this niceness above the server's (Linux only). Decoding and cutting
# an hour of MP3 takes a core for ~3 s; at equal priority it slowed the engine's two threads on
# two cores so much that the hour's first streamed text came after 3 s, at +4 after 0.35 s.
# The engine idles when it has no pieces, so preprocessing still gets the CPU it needs:
# throughput did not move (docs/benchmarks.md, "Pieces sent while the file is read").
PREPROCESS_NICENESS = 4


def _lower_priority() -> None:
    """Each pool thread's initializer. On Linux a thread's id names just that thread, and
    raising one's niceness needs no privilege."""
    if sys.platform.startswith("linux"):
        thread = threading.get_native_id()
        try:
            os.setpriority(os.PRIO_PROCESS, thread, min(19, os.getpriority(os.PRIO_PROCESS, thread) + PREPROCESS_NICENESS))
        except OSError:
            pass


class _Cancelled(Exception):
    pass


class PreprocessPool:
    def __init__(self, num_workers: int, max_duration_s: float | None):
        self.max_duration_s = max_duration_s
        self._executor = ThreadPoolExecutor(
            max_workers=num_workers, thread_name_prefix="preprocess", initializer=_lower_priority
        )
        self._lock = threading.Lock()
        self._num_queued = 0  # submitted, not yet started

    @property
    def num_queued(self) -> int:
        return self._num_queued

    async def prepare(self, data: bytes | bytearray, strategy: ChunkingStrategy = DEFAULT_CHUNKING) -> PreparedAudio:
        """Returns once the first pieces are cut (all of them for audio of 30 s or less): the
        rest come through the result's more(). Raises AudioError (and AudioTooLongError) for
        audio a user got wrong, when known before the first pieces."""
        with self._lock:
            self._num_queued += 1
        loop = asyncio.get_running_loop()
        audio = PreparedAudio([], None)
        audio._queue = asyncio.Queue()
        audio._future = self._executor.submit(self._run, data, strategy, audio, loop)
        try:
            first = await audio.more()
        except asyncio.CancelledError:
            if audio._future.cancel():  # never started: it leaves the queue now
                with self._lock:
                    self._num_queued -= 1
            audio.cancel()
            raise
        assert first is not None
        return audio

    def _run(self, data: bytes | bytearray, strategy: ChunkingStrategy, audio: PreparedAudio, loop) -> None:
        with self._lock:
            self._num_queued -= 1

        def send(item) -> None:
            try:
                loop.call_soon_threadsafe(audio._queue.put_nowait, item)
            except RuntimeError:  # the loop has closed: the server is gone
                audio.cancel()

        cutter: PieceCutter

        def on_progress(samples: np.ndarray, declared_s: float) -> None:
            if audio._cancelled.is_set():
                raise _Cancelled
            pieces = cutter.feed(samples)
            if pieces:
                send((pieces, max(declared_s, len(samples) / SAMPLE_RATE), None))

        # Whatever this raises reaches the request that waits on the queue: an error left in
        # the pool's future instead would leave it waiting for pieces that never come.
        try:
            cutter = PieceCutter(strategy)
            samples = load_audio(data, max_duration_s=self.max_duration_s, on_progress=on_progress)
            duration_s = len(samples) / SAMPLE_RATE
            send((cutter.finish(samples), duration_s, duration_s))
        except _Cancelled:
            pass
        except VADUnavailableError as error:
            send(vad_unavailable_error(error))
        except Exception as error:  # AudioError, or a bug: raised to the request that waits
            send(error)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
