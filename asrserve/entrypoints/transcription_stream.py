"""A transcription streamed as OpenAI's server-sent events: text deltas as the pieces decode,
then `transcript.text.done` (or an error event), and the stream's outcome for the metrics."""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING

from fastapi.responses import StreamingResponse

from asrserve.entrypoints.error_handlers import internal_error, job_error, shutting_down_error
from asrserve.entrypoints.live_decode import logprob_entry
from asrserve.entrypoints.middleware import CLIENT_CLOSED_SCOPE_KEY, STREAM_FAILED_SCOPE_KEY
from asrserve.entrypoints.protocol import usage_tokens
from asrserve.entrypoints.server_state import ServerState
from asrserve.entrypoints.transcription_job import TranscriptionJob

if TYPE_CHECKING:
    from asrserve.entrypoints.serving_transcription import TranscriptionParams

logger = logging.getLogger("asrserve.server")


class StreamOutcome:
    """How a stream ended, for the request count: its headers went out as 200 before the
    transcription could fail, and the status its error event stands for is what an operator's
    error rate must see."""

    def __init__(self):
        self.failed_status: int | None = None


class CleanupStreamingResponse(StreamingResponse):
    """Runs `cleanup` when the response ends for any reason, even if the client left before
    the first byte and the event generator never started. A stream the server's drain cut off
    (--graceful-shutdown-timeout-s ran out) ends with the `shutting_down` error a request not
    streamed gets, rather than mid-body with a traceback in the log."""

    def __init__(self, content, cleanup: Callable[[], None], outcome: StreamOutcome,
                 shutting_down: Callable[[], bool], **kwargs):
        super().__init__(content, **kwargs)
        self.cleanup = cleanup
        self.outcome = outcome
        self.shutting_down = shutting_down

    async def __call__(self, scope, receive, send) -> None:
        started = ended = done = False

        async def send_and_note(message) -> None:
            nonlocal started, ended, done
            started = started or message["type"] == "http.response.start"
            ended = ended or (message["type"] == "http.response.body" and not message.get("more_body", False))
            done = done or b"data: [DONE]" in message.get("body", b"")
            await send(message)

        try:
            await super().__call__(scope, receive, send_and_note)
            if not ended:  # Starlette stops a stream whose client left, and returns
                scope[CLIENT_CLOSED_SCOPE_KEY] = True
        except asyncio.CancelledError:
            if not (started and self.shutting_down()) or ended:
                raise  # (before the headers, the server answers 503 itself)
            if not done:  # (cut off after [DONE], the client has its transcript)
                self.outcome.failed_status = self.outcome.failed_status or 503
            last = b"" if done else sse(shutting_down_error().body()).encode()  # none after [DONE]
            await send({"type": "http.response.body", "body": last, "more_body": False})
        finally:
            if self.outcome.failed_status is not None:
                scope[STREAM_FAILED_SCOPE_KEY] = self.outcome.failed_status
            self.cleanup()


async def sse_events(
    state: ServerState, job: TranscriptionJob, job_params: TranscriptionParams, outcome: StreamOutcome,
) -> AsyncIterator[str]:
    include_logprobs, sent = bool(job_params.request.include), 0
    try:
        async for delta in _with_pings(job.deltas()):
            if delta is None:
                yield ": ping\n\n"  # an SSE comment: clients skip it, proxies see the stream alive
                continue
            event = {"type": "transcript.text.delta", "delta": delta}
            if include_logprobs:  # the tokens this delta's text came from
                event["logprobs"] = logprob_entries(state, job.shown_logprobs[sent:])
                sent = len(job.shown_logprobs)
            yield sse(event)
        # Each decode reads a window's 1500 audio positions and a prompt (the request's keywords
        # and prompt, at most 223 tokens).
        request = job_params.request
        prompt_tokens = state.tokenizer.num_prompt_tokens(request.prompt, request.prompt_head)
        usage = usage_tokens(job.num_decodes_shown * 1500, job.num_decodes_shown * prompt_tokens, job.num_output_tokens)
        done = {"type": "transcript.text.done", "text": job.text, "usage": usage}
        if include_logprobs:
            done["logprobs"] = logprob_entries(state, job.shown_logprobs)
        yield sse(done)
        yield "data: [DONE]\n\n"
        record_job(state, job, job_params)
    except Exception as error:  # the error a request not streamed would have got, as the last event
        failure = job_error(error)
        if failure is None:  # a bug: the client still learns that the stream failed, as a 500 would say
            logger.exception("a transcription stream failed (request %s)", job_params.request_id)
            failure = internal_error()
        outcome.failed_status = failure.status_code
        yield sse(failure.body())
    finally:
        job.abort()


# Seconds without a delta after which a comment line goes out: a long file's pieces decode side
# by side, and its first text can take longer than the idle timeout of a proxy in front (nginx's
# proxy_read_timeout and AWS ALB's idle timeout are 60 s by default), which cut the stream.
PING_INTERVAL_S = 15.0


async def _with_pings(deltas: AsyncIterator[str]) -> AsyncIterator[str | None]:
    """`deltas`, with None wherever PING_INTERVAL_S pass without one."""
    iterator = aiter(deltas)
    following = asyncio.ensure_future(anext(iterator))
    try:
        while True:
            done, _ = await asyncio.wait({following}, timeout=PING_INTERVAL_S)
            if not done:
                yield None
                continue
            try:
                delta = following.result()
            except StopAsyncIteration:
                return
            yield delta
            following = asyncio.ensure_future(anext(iterator))
    finally:  # (the client left, or a delta failed): the generator is closed once it is not running
        following.cancel()
        await asyncio.wait({following})
        if not following.cancelled():
            following.exception()  # (retrieved: it was raised above already, or nobody waits for it)
        await iterator.aclose()


def logprob_entries(state: ServerState, tokens: list[tuple[int, float]]) -> list[dict]:
    return [logprob_entry(state.tokenizer, token, logprob) for token, logprob in tokens]


def sse(payload: dict) -> str:
    return f"data: {json.dumps(payload, ensure_ascii=False)}\n\n"


def record_job(state: ServerState, job: TranscriptionJob, job_params: TranscriptionParams) -> None:
    metrics, endpoint = state.metrics, job_params.endpoint
    metrics.audio_seconds.labels(endpoint).inc(job.seconds_transcribed)
    metrics.output_tokens.labels(endpoint).inc(job.num_output_tokens)
    if job.first_token_time is not None:
        metrics.time_to_first_token.labels(endpoint).observe(job.first_token_time - job_params.arrival)
