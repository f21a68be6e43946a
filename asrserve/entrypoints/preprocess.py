"""Audio work off the event loop: a bounded pool of threads decodes each upload, mixes it to
mono, resamples it to 16 kHz and cuts it into pieces of at most 30 s (at quiet points, or at
voice-activity boundaries with the process's one shared Silero model).

Jobs wait in the pool's queue in arrival order. A job whose client has left is cancelled
before it starts; one already running finishes and is dropped."""

from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

from asrserve.audio.chunking import DEFAULT_CHUNKING, AudioPiece, ChunkingStrategy, cut_audio
from asrserve.audio.decode import load_audio
from asrserve.config import SAMPLE_RATE


def default_preprocess_workers() -> int:
    return max(1, min(os.cpu_count() or 1, 2))


@dataclass
class PreparedAudio:
    pieces: list[AudioPiece]
    duration_s: float


class PreprocessPool:
    def __init__(self, num_workers: int, max_duration_s: float | None):
        self.max_duration_s = max_duration_s
        self._executor = ThreadPoolExecutor(max_workers=num_workers, thread_name_prefix="preprocess")
        self._lock = threading.Lock()
        self._num_queued = 0  # submitted, not yet started

    @property
    def num_queued(self) -> int:
        return self._num_queued

    async def prepare(self, data: bytes | bytearray, strategy: ChunkingStrategy = DEFAULT_CHUNKING) -> PreparedAudio:
        """Raises AudioError (and AudioTooLongError) for audio a user got wrong."""
        with self._lock:
            self._num_queued += 1
        future: Future = self._executor.submit(self._run, data, strategy)
        try:
            return await asyncio.wrap_future(future)
        except asyncio.CancelledError:
            if future.cancel():  # never started: it leaves the queue now
                with self._lock:
                    self._num_queued -= 1
            raise

    def _run(self, data: bytes | bytearray, strategy: ChunkingStrategy) -> PreparedAudio:
        with self._lock:
            self._num_queued -= 1
        samples = load_audio(data, max_duration_s=self.max_duration_s)
        return PreparedAudio(cut_audio(samples, strategy), len(samples) / SAMPLE_RATE)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
