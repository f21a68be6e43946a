"""One live transcription session (OpenAI Realtime, `type: "transcription"`): its input audio
buffer, its turns (server VAD, or the client's commits) and the transcription of each item.

An item is the audio of one turn. While it grows, it is decoded again every
`interim_interval_s` and its stable words go out as deltas (entrypoints.live_interims). With
server VAD, the final decode starts as soon as a silence has lasted `pause_ms`, before the turn
is over (`silence_duration_ms`): if the person goes on speaking it is dropped; if not, the
transcript is ready about when the turn ends. A turn longer than Whisper's 30 s window is
decoded as consecutive segments of at most 30 s, cut at the quietest point near the limit;
the item's transcript is theirs joined. Only the audio of the open segment is kept."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Awaitable, Callable
from typing import Any

import numpy as np

from asrserve.audio.chunking import quietest_point
from asrserve.audio.streaming_vad import TurnDetector, TurnEvent, VADStream
from asrserve.config import N_SAMPLES, SAMPLE_RATE
from asrserve.entrypoints import live_decode
from asrserve.entrypoints.live_decode import LiveDecode, WordBoundaries
from asrserve.entrypoints.live_interims import interim_loop
from asrserve.entrypoints.live_item import (
    Item, RealtimeOptions, Segment, SessionAudio, SessionTasks, failed_event, sample_ms, user_item,
)
from asrserve.entrypoints.protocol import usage_duration
from asrserve.entrypoints.realtime_client_events import SESSION_UPDATES, session_of, session_updated
from asrserve.entrypoints.realtime_protocol import InputAudioDecoder, RealtimeError, SessionConfig, new_id, server_event
from asrserve.errors import shown

MIN_COMMIT_SAMPLES = SAMPLE_RATE // 10  # OpenAI refuses to commit less than 100 ms
CUT_SEARCH_SAMPLES = 5 * SAMPLE_RATE  # where a 30 s segment's cut is looked for


class RealtimeSession:
    def __init__(self, session_id: str, config: SessionConfig, options: RealtimeOptions, engine, tokenizer,
                 send: Callable[[dict], Awaitable[None]], run_vad: Callable[..., Awaitable[Any]], metrics):
        self.session_id = session_id
        self.config = config
        self.options = options
        self.engine = engine
        self.tokenizer = tokenizer
        self.send = send
        self.run_vad = run_vad  # runs a function off the event loop (the live VAD's thread)
        self.metrics = metrics
        self.words = WordBoundaries(tokenizer)
        self.decoder = InputAudioDecoder(config)
        self.audio = SessionAudio()
        self.item: Item | None = None  # the open (uncommitted) item
        self.previous_item_id: str | None = None
        self.heard_language: str | None = None  # of the last final whose language was sure (language_if_unsure)
        self.vad: VADStream | None = None
        self.turns: TurnDetector | None = None
        self._vad_origin = 0
        self.tasks = SessionTasks()  # final decodes, their emission, completions: cancelled on close
        self._interim: asyncio.Task | None = None
        self.last_completion: asyncio.Task | None = None  # items send text and complete in commit order
        self._start_vad()

    # --- client events --------------------------------------------------------------------

    async def handle(self, event: dict[str, Any]) -> None:
        kind = event.get("type")
        handler = {"input_audio_buffer.append": self._append, "input_audio_buffer.commit": self._commit,
                   "input_audio_buffer.clear": self._clear}.get(kind, self._update if kind in SESSION_UPDATES else None)
        if handler is None:
            raise RealtimeError(f"unknown or unsupported event type {shown(kind)} in a transcription session",
                                param="type", code="unknown_event_type")
        await handler(event)

    async def _update(self, event: dict[str, Any]) -> None:
        config = self.config.updated(session_of(event))
        if (config.format, config.rate) != (self.config.format, self.config.rate):
            # (the ~20 ms the old resampler held back end what was written: dropped, they cost the clock)
            tail, self.decoder = self.decoder.flush(), InputAudioDecoder(config)
            await self._take(tail, limited=False)
        vad_changed = config.turn_detection != self.config.turn_detection
        self.config = config
        if vad_changed:
            if self.item is not None:  # the pause it started at is not a pause to the new rules
                self._drop_early_final(self.item.segments[-1])
            self._start_vad()
        await self.send(session_updated(event, config.as_session(self.session_id)))

    async def _append(self, event: dict[str, Any]) -> None:
        await self._take(self.decoder.decode(event.get("audio")))

    async def _take(self, samples: np.ndarray, limited: bool = True) -> None:
        start = self.item.start if self.item is not None else self.audio.end  # (an append may open one)
        if limited and self.audio.end + len(samples) - start > self.options.max_buffer_s * SAMPLE_RATE:
            raise RealtimeError(f"the input audio buffer is full ({self.options.max_buffer_s:g} s uncommitted): "
                                "commit or clear it", param="audio", code="input_audio_buffer_full")
        self.audio.append(samples)
        if self.turns is None:
            if self.item is None and len(samples):
                self.item = self._new_item(self.audio.end - len(samples))
        else:
            probs = await self.run_vad(self.vad.push, samples)
            first = self.vad.num_windows - len(probs)
            for turn in self.turns.feed(probs, first):
                if not self.tasks.has_room:  # one append of minutes may hold a hundred turns
                    self._cancel_interim()  # (it would read the turns after this one into it)
                    await self.tasks.room()
                if self.tasks.closed:  # the client left while it waited
                    return
                await self._on_turn(turn)
            if self.item is None:  # keep only what the next turn's prefix padding needs
                self.audio.drop_before(self.audio.end - self._padding)
        while self.item is not None and self.audio.end - self.item.segments[-1].start >= N_SAMPLES:
            self._close_full_segment(self.item)  # (one append may hold minutes)
        self._ensure_interim_loop()

    async def _commit(self, event: dict[str, Any]) -> None:
        self.audio.append(self.decoder.flush())
        # With no item open, what the buffer kept is committed: with server VAD, the prefix
        # padding of what came since the last turn (no speech was heard); without, nothing.
        start = self.item.start if self.item is not None else self.audio.origin
        if self.audio.end - start < MIN_COMMIT_SAMPLES:
            raise RealtimeError("the input audio buffer holds less than 100 ms of audio to commit",
                                code="input_audio_buffer_commit_empty")
        item = self.item or self._new_item(start)
        if self.turns is not None:
            # The turn ends here, whatever VAD was hearing; VAD starts again after what was
            # committed (the resampler's tail included, which it never heard).
            self._start_vad()
        await self._finish_item(item, self.audio.end)

    async def _clear(self, event: dict[str, Any]) -> None:
        item, self.item = self.item, None
        if item is not None:  # its decodes stop, and a closed segment's text is not sent after all
            for task in (t for segment in item.segments for t in (segment.final, segment.emitted) if t is not None):
                task.cancel()
        self._cancel_interim()
        if item is not None and item.sent:  # deltas of audio that is gone: the client is told to drop them
            await self.send(failed_event(item.item_id, "input_audio_buffer_cleared", "the buffer was cleared"))
        self.audio.append(self.decoder.flush())  # (counted: audio_start_ms drifted 20 ms a clear)
        self.audio.drop_before(self.audio.end)
        self._start_vad()
        await self.send(server_event("input_audio_buffer.cleared"))

    # --- turns ----------------------------------------------------------------------------

    def _start_vad(self) -> None:
        detection = self.config.turn_detection
        if detection is None:
            self.vad = self.turns = None
            return
        self.vad = VADStream()
        self.turns = TurnDetector(detection.threshold, detection.silence_duration_ms, self.options.pause_ms)
        self._vad_origin = self.audio.end

    @property
    def _padding(self) -> int:
        """Samples of prefix padding server VAD keeps before a turn's speech."""
        return self.config.turn_detection.prefix_padding_ms * SAMPLE_RATE // 1000

    async def _on_turn(self, turn: TurnEvent) -> None:
        sample = self._vad_origin + turn.sample
        if turn.kind == "start" and (self.item is None or not self.item.speech_started):
            # (An item is open without it where appends opened it before server VAD was on.)
            self.item = self.item or self._new_item(max(self.audio.origin, sample - self._padding))
            self.item.speech_started = True
            await self.send(server_event(
                "input_audio_buffer.speech_started", item_id=self.item.item_id,
                audio_start_ms=sample_ms(max(self.item.start, sample - self._padding)),
            ))
        elif self.item is None:
            return
        elif turn.kind == "pause":  # an interim decode now would only delay the final
            self._cancel_interim()
            # Early, to be ready when the turn ends: up to where the pause was heard, not to the
            # end of the append, which may hold the next turn's words.
            end = self._vad_origin + turn.heard_until
            if end - self.item.segments[-1].start <= N_SAMPLES:
                self._start_final(self.item.segments[-1], end)
        elif turn.kind == "resume":
            self._drop_early_final(self.item.segments[-1])
        elif turn.kind == "stop":
            item = self.item
            await self.send(server_event("input_audio_buffer.speech_stopped", audio_end_ms=sample_ms(sample),
                                         item_id=item.item_id))
            await self._finish_item(item, sample)

    @staticmethod
    def _drop_early_final(segment: Segment) -> None:
        """The final decode started at a pause is not the turn's: the person went on."""
        if segment.final is not None:
            segment.final.cancel()
            segment.final = None

    def _new_item(self, start: int) -> Item:
        return Item(new_id("item"), start, [Segment(start, decoded_until=start)], language=self.config.language)

    # --- transcription ----------------------------------------------------------------------

    async def _finish_item(self, item: Item, end: int) -> None:
        """Commits the item: its last segment's final decode (started early, or now), then the
        rest of its text and `completed`: at once where the final is done (it starts at the
        turn's first pause, so it usually is), in the background otherwise."""
        committed_at = time.monotonic()
        self.item = None
        self._cancel_interim()
        while end - item.segments[-1].start > N_SAMPLES:  # more than 30 s came in one append
            self._close_full_segment(item)
        segment = item.segments[-1]
        if segment.final is None:
            self._start_final(segment, max(end, segment.start + 1))
        ready = self._ready(item)
        if not ready:
            self._emit_final(item, segment)
        item.previous_item_id = self.previous_item_id
        await self.send(server_event("input_audio_buffer.committed", item_id=item.item_id,
                                     previous_item_id=item.previous_item_id))
        await self.send(server_event("conversation.item.added", previous_item_id=item.previous_item_id,
                                     item=user_item(item.item_id, None, "in_progress")))
        self.previous_item_id = item.item_id
        self.audio.drop_before(end)
        if ready:
            # No task in between: beside uploads each hop from one task to the next waited
            # behind the event loop's other work (end of speech -> completed p99 4-7 ms against
            # 0.5 alone, with the final done before the turn ended).
            await self._send_final_text(item, segment)
            await self._send_completed(item, end, committed_at)
        else:
            self.last_completion = self.tasks.spawn(self._complete(item, end, committed_at, self.last_completion))

    def _ready(self, item: Item) -> bool:
        """Whether the item's text can go out now: its final decode done, the segments before it
        sent, the items before it completed."""
        tasks = [item.segments[-1].final, *(s.emitted for s in item.segments[:-1])]
        if self.last_completion is not None:
            tasks.append(self.last_completion)
        return all(t is not None and t.done() and not t.cancelled() and t.exception() is None for t in tasks)

    def _close_full_segment(self, item: Item) -> None:
        """The open segment has reached 30 s: cut it at its quietest point near the end and
        start the next segment there."""
        segment = item.segments[-1]
        limit = segment.start + N_SAMPLES
        search_start = limit - CUT_SEARCH_SAMPLES
        cut = search_start + quietest_point(self.audio.slice(search_start, limit))
        if segment.final is not None:  # an early final of a longer span: decode to the cut instead
            segment.final.cancel()
            segment.final = None
        self._start_final(segment, cut)
        self._emit_final(item, segment)
        item.segments.append(Segment(cut, decoded_until=cut))
        self.audio.drop_before(cut)

    def _start_final(self, segment: Segment, end: int) -> None:
        if segment.final is not None:
            return
        params = live_decode.final_params(bool(segment.stable), self.config.languages,
                                          live_decode.session_language(self.heard_language, self.config.languages))
        segment.final = self.tasks.spawn(live_decode.decode(
            self.engine, self.tokenizer, self.audio.slice(segment.start, end), self.config.language, self.config.prompt,
            segment.stable, params, final=True, previous=segment.previous, prompt_head=self.config.prompt_head,
        ))
        self.options.finals.track(segment.final)

    def _emit_final(self, item: Item, segment: Segment) -> None:
        """Sends the segment's final text once the segments and items before it have sent theirs
        (livekit-agents adds deltas to one text until `completed`: a short turn overtaking broke it)."""
        index = item.segments.index(segment)
        before = item.segments[index - 1].emitted if index else None
        earlier = None if index else self.last_completion

        async def emit() -> None:
            if earlier is not None:
                await asyncio.wait({earlier})  # however it ended
            if before is not None:
                await before
            await segment.final
            await self._send_final_text(item, segment)

        segment.emitted = self.tasks.spawn(emit())

    async def _send_final_text(self, item: Item, segment: Segment) -> None:
        """The segment's final text past what its interims sent (its final decode is done)."""
        result: LiveDecode = segment.final.result()
        if result.no_speech and not segment.stable:
            return
        if result.language and result.language_sure:
            self.heard_language = result.language
        await self.extend(item, segment, segment.stable + result.token_ids,
                          segment.stable_logprobs + result.logprobs, result.language)

    async def _complete(self, item: Item, end: int, committed_at: float, before: asyncio.Task | None) -> None:
        try:
            if before is not None:
                await asyncio.wait({before})  # however it ended
            await item.segments[-1].emitted
        except (Exception, asyncio.CancelledError) as error:  # the engine failed, or the session closed first
            message = str(error) or "the session closed before the transcript was done"
            await self.send(failed_event(item.item_id, "transcription_failed", message))
            if isinstance(error, asyncio.CancelledError):
                raise
            return
        await self._send_completed(item, end, committed_at)

    async def _send_completed(self, item: Item, end: int, committed_at: float) -> None:
        seconds = (end - item.start) / SAMPLE_RATE
        num_tokens = sum(len(segment.stable) for segment in item.segments)
        self.metrics.record_live_item(time.monotonic() - committed_at, seconds, num_tokens)
        completed = {"item_id": item.item_id, "content_index": 0, "transcript": item.sent,
                     "usage": usage_duration(seconds)}
        if self.config.include_logprobs:
            completed["logprobs"] = item.logprobs
        await self.send(server_event("conversation.item.input_audio_transcription.completed", **completed))
        await self.send(server_event("conversation.item.done", previous_item_id=item.previous_item_id,
                                     item=user_item(item.item_id, item.sent, "completed")))

    async def extend(self, item: Item, segment: Segment, tokens: list[int], logprobs: list[float],
                     language: str | None) -> None:
        """The segment's text is now that of `tokens` (which begin with what was sent): sends
        the difference as a delta."""
        delta = item.extend(segment, tokens, logprobs, language, self.tokenizer, self.config.include_logprobs)
        if delta is not None:
            await self.send(server_event("conversation.item.input_audio_transcription.delta", **delta))

    # --- interim decodes --------------------------------------------------------------------

    def _ensure_interim_loop(self) -> None:
        if self.options.interim_interval_s > 0 and (self._interim is None or self._interim.done()):
            self._interim = asyncio.ensure_future(interim_loop(self))

    def _cancel_interim(self, why: str | None = None) -> None:
        if self._interim is not None:
            self._interim.cancel(why)
            self._interim = None

    # --- life --------------------------------------------------------------------------------

    async def finish(self) -> None:
        """The session ends (server stopping, client idle): commits the open turn, waits for every item."""
        if self.tasks.closed:  # the client is gone: nothing to tell it
            return
        if self.item is not None and self.audio.end - self.item.start >= MIN_COMMIT_SAMPLES:
            await self._commit({})
        if self.last_completion is not None:
            await asyncio.wait({self.last_completion})

    def close(self) -> list[asyncio.Task]:
        """The client left, or shutdown cannot wait: its decodes stop; returns the tasks it cancelled."""
        self._cancel_interim(live_decode.SESSION_ENDED)
        return self.tasks.cancel(live_decode.SESSION_ENDED)
