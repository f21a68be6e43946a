"""What a live session keeps: its audio, its items (one per turn) and their segments (up to
30 s each, one Whisper window), and the server's live transcription options."""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from asrserve.config import SAMPLE_RATE
from asrserve.entrypoints.live_decode import logprob_entry
from asrserve.entrypoints.pieces import joiner
from asrserve.entrypoints.realtime_protocol import server_event


class FinalsInFlight:
    """The final decodes running across all sessions. Interim decodes wait while any runs: a
    final is what someone waits for at the end of a turn, an interim only brings text forward,
    and on a small CPU the two would share its cores. When finals follow one another without a
    gap (an overloaded machine), interim text is what is shed: speakers then get their text at
    the end of each turn. (A bounded wait, tried, measured worse; docs/benchmarks.md.)"""

    def __init__(self) -> None:
        self.count = 0
        self.none = asyncio.Event()
        self.none.set()

    def track(self, final: asyncio.Task) -> None:
        self.count += 1
        self.none.clear()
        final.add_done_callback(self._done)

    def _done(self, _: asyncio.Task) -> None:
        self.count -= 1
        if self.count == 0:
            self.none.set()


@dataclass
class RealtimeOptions:
    interim_interval_s: float = 0.5  # 0: no interim decodes (text only once an item is committed)
    pause_ms: float = 100  # silence after which the final decode starts early (server VAD)
    max_buffer_s: float = 300  # longest uncommitted item
    # Interim decodes in flight across all sessions: each is a full encoder forward, so on a
    # small CPU a few sessions' interims would crowd out the final decodes that users wait
    # for. Sessions wait their turn for a slot (first come, first served).
    interim_slots: asyncio.Semaphore = field(default_factory=lambda: asyncio.Semaphore(1))
    finals: FinalsInFlight = field(default_factory=FinalsInFlight)


@dataclass
class Segment:
    """Up to 30 s of an item, decoded as one Whisper window."""

    start: int  # session sample offset
    stable: list[int] = field(default_factory=list)  # tokens sent: every later decode's prefix
    stable_logprobs: list[float] = field(default_factory=list)
    previous: list[int] | None = None  # the last interim decode (prefix included)
    decoded_until: int = 0  # audio end of the last interim decode
    text: str = ""  # sent so far for this segment
    final: asyncio.Task | None = None  # the final decode, once started (maybe early)
    emitted: asyncio.Task | None = None  # its final text sent (in segment order)


@dataclass
class Item:
    item_id: str
    start: int
    segments: list[Segment]
    sent: str = ""  # every delta so far, joined
    logprobs: list[dict[str, Any]] = field(default_factory=list)
    language: str | None = None
    previous_item_id: str | None = None  # the item committed before it, once it is committed
    speech_started: bool = False  # announced (server VAD heard its speech begin)

    def extend(self, segment: Segment, tokens: list[int], logprobs: list[float], language: str | None,
               tokenizer, include_logprobs: bool) -> dict[str, Any] | None:
        """The segment's text is now that of `tokens` (which begin with what was sent): the
        delta event's fields for the difference, or None where the text did not grow."""
        self.language = self.language or language
        text = tokenizer.decode(tokens).strip()
        assert text.startswith(segment.text), (text, segment.text)
        delta = text[len(segment.text):]
        new_tokens, new_logprobs = tokens[len(segment.stable):], logprobs[len(segment.stable):]
        segment.stable, segment.stable_logprobs, segment.text = list(tokens), list(logprobs), text
        if not delta:
            return None
        if len(segment.text) == len(delta) and self.sent:  # the segment's first words
            delta = joiner(self.language, self.language) + delta
        self.sent += delta
        event: dict[str, Any] = {"item_id": self.item_id, "content_index": 0, "delta": delta}
        if include_logprobs:
            entries = [logprob_entry(tokenizer, *pair) for pair in zip(new_tokens, new_logprobs)]
            self.logprobs.extend(entries)
            event["logprobs"] = entries
        return event


# A session's turns still being transcribed, as tasks (a final decode, its text, its completion:
# about three a turn). Past this many the session reads no more events until some finish.
MAX_SESSION_TASKS = 24


class SessionTasks:
    """A live session's background work: cancelled with the session, and bounded."""

    def __init__(self) -> None:
        self.running: set[asyncio.Task] = set()
        self.closed = False  # the session ended: nothing more is to start
        self.finished_at = 0.0  # (time.monotonic) when the last of them ended

    def spawn(self, work) -> asyncio.Task:
        task = asyncio.ensure_future(work)
        self.running.add(task)
        task.add_done_callback(self._finished)
        return task

    def _finished(self, task: asyncio.Task) -> None:
        self.running.discard(task)
        self.finished_at = time.monotonic()

    def idle_wait_s(self, last_event: float, idle_timeout: float) -> float:
        """How much longer the session may wait for its client's next event: the idle timeout
        runs from the client's last event (time.monotonic) or the end of the session's last
        transcription, whichever is later, and not while one runs (a client waiting for its
        transcript is not idle; counted from its last event, one whose transcript outlasted the
        timeout was closed as it came)."""
        if self.running:
            return idle_timeout
        return idle_timeout - (time.monotonic() - max(last_event, self.finished_at))

    def cancel(self, why: str) -> list[asyncio.Task]:
        self.closed = True
        tasks = list(self.running)
        for task in tasks:
            task.cancel(why)
        return tasks

    @property
    def has_room(self) -> bool:
        return len(self.running) < MAX_SESSION_TASKS or self.closed

    async def room(self) -> None:
        """Waits while the session has MAX_SESSION_TASKS: a client that commits in a loop, or
        appends an hour of turns at once, waits for its own transcripts (finals are served
        ahead of all file work; 1000 commits queued 969 of them before everyone else's)."""
        while not self.has_room:
            await asyncio.wait(set(self.running), return_when=asyncio.FIRST_COMPLETED)


class SessionAudio:
    """The session's 16 kHz audio from `origin` (a sample offset since the session began)."""

    def __init__(self) -> None:
        self.origin = 0
        self._chunks: list[np.ndarray] = []
        self.end = 0

    def append(self, samples: np.ndarray) -> None:
        self._chunks.append(samples)
        self.end += len(samples)

    def slice(self, start: int, end: int) -> np.ndarray:
        assert self.origin <= start <= end <= self.end, (self.origin, start, end, self.end)
        audio = np.concatenate(self._chunks) if len(self._chunks) != 1 else self._chunks[0]
        self._chunks = [audio]
        return audio[start - self.origin : end - self.origin].copy()

    def drop_before(self, offset: int) -> None:
        offset = min(max(offset, self.origin), self.end)
        if offset > self.origin:
            audio = self.slice(offset, self.end)
            self._chunks, self.origin = [audio], offset


def sample_ms(sample: int) -> int:
    """A 16 kHz sample offset in whole milliseconds (the protocol's audio_start_ms, audio_end_ms)."""
    return sample * 1000 // SAMPLE_RATE


def user_item(item_id: str, transcript: str | None, status: str) -> dict[str, Any]:
    return {"id": item_id, "object": "realtime.item", "type": "message", "role": "user", "status": status,
            "content": [{"type": "input_audio", "transcript": transcript}]}


def failed_event(item_id: str, code: str, message: str) -> dict[str, Any]:
    """conversation.item.input_audio_transcription.failed for the item (OpenAI's shape)."""
    return server_event("conversation.item.input_audio_transcription.failed", item_id=item_id, content_index=0,
                        error={"type": "server_error", "code": code, "message": message, "param": None})
