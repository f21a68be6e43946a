"""The requests waiting for admission, in two classes: interactive (a live session's decodes,
where someone waits for the text) before batch (file uploads). FCFS within each class, except
that an urgent interactive request (a live turn's final decode, whose text ends the turn) goes
ahead of the other interactive ones (interims, which only bring text forward).

Latency first, without starving either class:
- An interactive request is always next in line, ahead of every queued file request.
- While an urgent request decodes (a few hundred ms), only urgent requests are admitted; the
  others are held at most MAX_URGENT_HOLD_S, so finals back to back starve nothing.
- While interactive requests run, file requests are admitted one at a time, at most one per
  `batch_admit_interval_s`. Each admission puts a 30 s window through the encoder in the same
  step as the live decodes (on a small CPU that one forward costs as much as a dozen decode
  steps), so this bounds what file work adds to a live decode's latency, and guarantees file
  work a steady share (one window per interval; while finals decode, up to MAX_URGENT_HOLD_S
  later).
- With no interactive request running, file requests are admitted as before, as many as fit.
- The encoder batch (encoder_budget): while live decodes wait or run, and for LIVE_PAUSE_S
  after, interactive_encoder_batch audios a step (1 on CPU, whose encoder runs one audio after
  another), so a final decode that arrives waits behind at most that many other forwards.
- With `finals_alone` (on CPU), running file sequences sit out the steps of a final decode
  (batch_sits_out): a CPU step's time grows with its rows, each of which reads its audio's whole
  cross-attention K/V, and 30 file rows made each of a final's ~20 steps several times longer.
  At most MAX_URGENT_HOLD_S in a row, and never more than half the time: after sitting out a
  while, file sequences run at least as long, so finals back to back starve nothing.
A preempted request goes back to the front of its own class (an interim: behind the finals).
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Iterator

from asrserve.config import SchedulerConfig
from asrserve.engine.request import Request


# The longest a request other than a final decode is held back while finals decode.
MAX_URGENT_HOLD_S = 1.0
# The encoder batch stays at interactive_encoder_batch this long after the last live decode
# waited or ran: a live session pauses between turns (server VAD commits after 0.5 s of
# silence, the next turn's speech comes a second or two later), and a file batch encoding
# max_encoder_batch audios in that gap (~1.1 s for 8 on 2 CPU cores) is what the next turn's
# final decode would find in its way. File admissions are not held back: one a step still
# keeps the encoder busy.
LIVE_PAUSE_S = 2.0


class WaitingQueue:
    def __init__(self, batch_admit_interval_s: float, clock: Callable[[], float] = time.monotonic):
        self.batch_admit_interval_s = batch_admit_interval_s
        self.clock = clock
        self.interactive: deque[Request] = deque()
        self.batch: deque[Request] = deque()
        self._last_batch_admission = -float("inf")
        self._held_since: float | None = None  # since when urgent work holds the rest back
        self._live_until = -float("inf")  # the small encoder batch holds until then (LIVE_PAUSE_S)
        self._sat_out_since: float | None = None  # since when file sequences sit out finals' steps
        self._batch_runs_until = -float("inf")  # ... and until when they run, having sat out

    def _queue(self, request: Request) -> deque[Request]:
        return self.interactive if request.interactive else self.batch

    def _after_urgent(self) -> int:
        return next((i for i, r in enumerate(self.interactive) if not r.urgent), len(self.interactive))

    def append(self, request: Request) -> None:
        if request.urgent:
            self.interactive.insert(self._after_urgent(), request)  # behind the finals, ahead of interims
            return
        self._queue(request).append(request)

    def appendleft(self, request: Request) -> None:
        """Back to the front of its class (a preempted request resumes first; an interim
        behind the waiting finals)."""
        if request.interactive and not request.urgent:
            self.interactive.insert(self._after_urgent(), request)
            return
        self._queue(request).appendleft(request)

    def remove(self, request: Request) -> None:
        queue = self._queue(request)
        if queue and queue[0] is request and not request.urgent:
            self._held_since = None  # it was the one held: the next one waits its own hold
        queue.remove(request)

    def __len__(self) -> int:
        return len(self.interactive) + len(self.batch)

    def __iter__(self) -> Iterator[Request]:
        """In admission order."""
        yield from self.interactive
        yield from self.batch

    def encoder_budget(self, interactive_running: bool, config: SchedulerConfig) -> int:
        """Audios this step's encoder may take: config.interactive_encoder_batch while live
        decodes wait or run and for LIVE_PAUSE_S after, config.max_encoder_batch otherwise."""
        now = self.clock()
        if interactive_running or self.interactive:
            self._live_until = now + LIVE_PAUSE_S
        if now < self._live_until and config.interactive_encoder_batch is not None:
            return config.interactive_encoder_batch
        return config.max_encoder_batch

    def batch_sits_out(self, running: list[Request]) -> bool:
        """Whether the running file sequences sit out this step (finals_alone): while a final
        decode runs beside them, for at most MAX_URGENT_HOLD_S in a row, then for at least as
        long they run."""
        beside_final = any(r.urgent for r in running) and not all(r.interactive for r in running)
        if not beside_final and self._sat_out_since is None:
            return False  # (most steps: no clock read)
        now = self.clock()
        if beside_final and now >= self._batch_runs_until:
            self._sat_out_since = now if self._sat_out_since is None else self._sat_out_since
            if now - self._sat_out_since < MAX_URGENT_HOLD_S:
                return True
        if self._sat_out_since is not None:
            self._batch_runs_until = now + (now - self._sat_out_since)
            self._sat_out_since = None
        return False

    def next_admissible(self, interactive_running: bool, urgent_running: bool = False) -> Request | None:
        """The request to admit next, or None if none may be admitted in this step now.
        While an urgent request decodes, only urgent ones are admitted, for at most
        MAX_URGENT_HOLD_S: every admission puts an encoder forward into the running decodes'
        next step (~140-200 ms on 2 CPU cores), and the final decodes are what users wait for;
        the rest waits the few hundred ms they run. With finals back to back (more live
        sessions than the machine holds) the bound keeps interims and file work going."""
        if self.interactive and self.interactive[0].urgent:
            return self.interactive[0]
        if not urgent_running:
            self._held_since = None
        elif self.interactive or self.batch:
            now = self.clock()
            self._held_since = now if self._held_since is None else self._held_since
            if now - self._held_since < MAX_URGENT_HOLD_S:
                return None
        if self.interactive:
            return self.interactive[0]
        if not self.batch:
            return None
        if interactive_running and self.clock() - self._last_batch_admission < self.batch_admit_interval_s:
            return None
        return self.batch[0]

    def pop(self, request: Request) -> None:
        """Takes the request next_admissible returned out of the queue."""
        if not request.urgent:
            self._held_since = None  # the next one held waits its own MAX_URGENT_HOLD_S
        if request.interactive:
            assert self.interactive[0] is request
            self.interactive.popleft()
            return
        assert self.batch[0] is request
        self.batch.popleft()
        self._last_batch_admission = self.clock()
