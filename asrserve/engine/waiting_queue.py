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
- With no interactive request running, file requests are admitted as many as fit, but a
  later piece of an upload (follows_earlier_text), while streamed requests (stream_tokens: a
  client reads their text as it comes) decode, waits until steps that run the encoder have
  taken at most `encoder_time_share` of the time (step_started, step_finished): after a step
  with encoder work that took T, until decode-only steps have run T * (1 - share) / share; a
  first piece behind it goes ahead. On a CPU one 30 s window costs as much as dozens of decode
  steps, and with a backlog of pieces (several long uploads at once) every step carried one:
  running decodes advanced a token per encoder forward and a stream's first text waited for
  nearly the whole backlog to be encoded. Short files are first pieces, each its own stream's
  first text, and are never held (held, their time to first token went from 1.0 to 4.1 s at
  concurrency 8); nor is anything beside decodes whose text is sent whole (json, offline),
  for which the larger decode batches finish everything sooner. A later piece is held whether
  its own upload is streamed or not, and for at most MAX_LATER_PIECE_HOLD_S in a row: every
  admission ahead of it (a first piece, a live decode) starts another hold.
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
from collections.abc import Callable, Iterable, Iterator

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
# The longest a later piece is held in a row beside streamed decodes (encoder_time_share):
# every admission ahead of it starts another hold, so a steady flow of short files or live
# decodes would otherwise hold a long upload's later pieces, and its text, as long as it lasts.
MAX_LATER_PIECE_HOLD_S = 1.0


class WaitingQueue:
    def __init__(self, batch_admit_interval_s: float, clock: Callable[[], float] = time.monotonic,
                 encoder_time_share: float = 1.0):
        self.batch_admit_interval_s = batch_admit_interval_s
        self.encoder_time_share = encoder_time_share
        self.clock = clock
        self.interactive: deque[Request] = deque()
        self.batch: deque[Request] = deque()
        self._last_batch_admission = -float("inf")
        self._held_since: float | None = None  # since when urgent work holds the rest back
        self._live_until = -float("inf")  # the small encoder batch holds until then (LIVE_PAUSE_S)
        self._sat_out_since: float | None = None  # since when file sequences sit out finals' steps
        self._batch_runs_until = -float("inf")  # ... and until when they run, having sat out
        self._encoder_step_began: float | None = None
        self._decodes_alone_until = -float("inf")  # until then later pieces wait beside streamed decodes
        self._later_held_since: float | None = None  # since when the batch head is such a piece, held

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
            self._held_since = self._later_held_since = None  # it was the one held: the next waits its own
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

    @staticmethod
    def streams_text(decodes: Iterable[Request]) -> bool:
        """Whether any of these decodes is a file request whose text a client reads as it comes."""
        return any(r.sampling_params.stream_tokens and not r.interactive for r in decodes)

    def step_started(self) -> None:
        """A step is being scheduled (an admission in it, pop, times it)."""
        self._encoder_step_began = None

    def step_finished(self) -> None:
        """The step has ended: after one that ran the encoder, decode-only steps get their share."""
        if self._encoder_step_began is not None:
            now = self.clock()
            took = now - self._encoder_step_began
            self._decodes_alone_until = now + took * (1 - self.encoder_time_share) / self.encoder_time_share
            self._encoder_step_began = None

    def next_admissible(self, interactive_running: bool, urgent_running: bool = False,
                        streaming: Callable[[], bool] = lambda: False) -> Request | None:
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
        # streamed decodes' share of time (encoder_time_share); a stream's first piece goes ahead.
        # streaming() scans the running rows: asked last, only while a later piece would be held.
        head = self.batch[0]
        if head.sampling_params.follows_earlier_text and (now := self.clock()) < self._decodes_alone_until \
                and streaming():
            self._later_held_since = now if self._later_held_since is None else self._later_held_since
            if now - self._later_held_since < MAX_LATER_PIECE_HOLD_S:
                return next((r for r in self.batch if not r.sampling_params.follows_earlier_text), None)
        else:
            self._later_held_since = None
        return head

    def pop(self, request: Request) -> None:
        """Takes the request next_admissible returned out of the queue."""
        if self._encoder_step_began is None and self.encoder_time_share < 1:
            self._encoder_step_began = self.clock()  # this step runs the encoder
        if not request.urgent:
            self._held_since = None  # the next one held waits its own MAX_URGENT_HOLD_S
        if request.interactive:
            assert self.interactive[0] is request
            self.interactive.popleft()
            return
        if self.batch[0] is request:
            self.batch.popleft()
            self._later_held_since = None
        else:  # a stream's first piece, ahead of later pieces held back (next_admissible)
            self.batch.remove(request)
        self._last_batch_admission = self.clock()
