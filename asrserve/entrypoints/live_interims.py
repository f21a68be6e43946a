"""A live item's interim decodes: the open segment decoded again while the person speaks, its
stable words sent as deltas (entrypoints.live_decode says which words are stable)."""

from __future__ import annotations

import asyncio
from typing import TYPE_CHECKING

from asrserve.config import SAMPLE_RATE
from asrserve.engine.async_client import EngineDeadError
from asrserve.entrypoints import live_decode

if TYPE_CHECKING:
    from asrserve.entrypoints.realtime_session import RealtimeSession

MIN_INTERIM_SAMPLES = SAMPLE_RATE // 2  # an interim decode of less says little


async def interim_loop(session: RealtimeSession) -> None:
    """Decodes the open segment while an item is open, one decode at a time, each due
    interim_interval_s after the last one started (at once if that one took longer), so
    text keeps pace with speech even when a decode takes about the interval. Sessions
    take the engine's interim slots in turn (first come, first served) and wait while any
    session's final decode runs; ends with the item."""
    clock = asyncio.get_running_loop()
    due = clock.time() + session.options.interim_interval_s
    while (item := session.item) is not None:
        await asyncio.sleep(max(0.0, due - clock.time()))
        floor = live_decode.STABLE_LOGPROB_BY_DELAY[session.config.delay or "medium"]
        if floor is None:  # delay "xhigh": no text before the final decode, so no interim decodes
            due = clock.time() + session.options.interim_interval_s
            continue
        async with session.options.interim_slots:
            await session.options.finals.none.wait()  # finals first
            due = clock.time() + session.options.interim_interval_s
            if session.item is not item:
                return
            segment, end = item.segments[-1], session.audio.end
            if (segment.final is not None or end - segment.start < MIN_INTERIM_SAMPLES
                    or end - segment.decoded_until < SAMPLE_RATE // 5
                    or any(not s.emitted.done() for s in item.segments[:-1])
                    or (session.last_completion is not None and not session.last_completion.done())):
                continue  # a final runs, too little audio, too little new, or an earlier segment or item pending
            segment.decoded_until = end
            try:
                result = await live_decode.decode(
                    session.engine, session.tokenizer, session.audio.slice(segment.start, end),
                    session.config.language, session.config.prompt, segment.stable,
                    live_decode.interim_params(session.config.languages, live_decode.session_language(
                        session.heard_language, session.config.languages)),
                    previous=segment.previous, prompt_head=session.config.prompt_head,
                )
            except EngineDeadError:
                return  # the item's final decode reports it (its `failed` event), once
        if session.item is not item or item.segments[-1] is not segment or segment.final is not None:
            continue
        if result.no_speech:
            segment.previous = None
            continue
        current = segment.stable + result.token_ids
        logprobs = segment.stable_logprobs + result.logprobs
        if segment.previous is not None:
            times = None if result.token_times is None else [0.0] * len(segment.stable) + result.token_times
            latest = (end - segment.start) / SAMPLE_RATE - live_decode.STABLE_MARGIN_S
            stable = session.words.stable_length(segment.previous, current, len(segment.stable),
                                                 item.language or result.language, times, latest,
                                                 logprobs, floor)
            if stable > len(segment.stable):
                await session.extend(item, segment, current[:stable], logprobs[:stable], result.language)
        segment.previous = current
