"""The requests waiting for admission, in two classes: interactive (a live session's decodes,
where someone waits for the text) before batch (file uploads). FCFS within each class.

Latency first, without starving either class:
- An interactive request is always next in line, ahead of every queued file request.
- While interactive requests run, file requests are admitted one at a time, at most one per
  `batch_admit_interval_s`. Each admission puts a 30 s window through the encoder in the same
  step as the live decodes (on a small CPU that one forward costs as much as a dozen decode
  steps), so this bounds what file work adds to a live decode's latency, and guarantees file
  work a steady share (one window per interval) however busy the live sessions keep the engine.
- With no interactive request running, file requests are admitted as before, as many as fit.
A preempted request goes back to the front of its own class.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

from asrserve.engine.request import Request


class WaitingQueue:
    def __init__(self, batch_admit_interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.batch_admit_interval_s = batch_admit_interval_s
        self.clock = clock
        self.interactive: deque[Request] = deque()
        self.batch: deque[Request] = deque()
        self._last_batch_admission = -float("inf")

    def _queue(self, request: Request) -> deque[Request]:
        return self.interactive if request.interactive else self.batch

    def append(self, request: Request) -> None:
        self._queue(request).append(request)

    def appendleft(self, request: Request) -> None:
        """Back to the front of its class (a preempted request resumes first)."""
        self._queue(request).appendleft(request)

    def remove(self, request: Request) -> None:
        self._queue(request).remove(request)

    def __len__(self) -> int:
        return len(self.interactive) + len(self.batch)

    def __iter__(self) -> Iterator[Request]:
        """In admission order."""
        yield from self.interactive
        yield from self.batch

    def next_admissible(self, interactive_running: bool) -> Request | None:
        """The request to admit next, or None if none may be admitted in this step now."""
        if self.interactive:
            return self.interactive[0]
        if not self.batch:
            return None
        if interactive_running and self.clock() - self._last_batch_admission < self.batch_admit_interval_s:
            return None
        return self.batch[0]

    def pop(self, request: Request) -> None:
        """Takes the request next_admissible returned out of the queue."""
        if request.interactive:
            assert self.interactive[0] is request
            self.interactive.popleft()
            return
        assert self.batch[0] is request
        self.batch.popleft()
        self._last_batch_admission = self.clock()
