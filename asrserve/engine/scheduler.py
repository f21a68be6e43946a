"""Continuous batching: which requests the next step's encoder and decoder forwards cover.

FCFS. Running requests come first, oldest first, each needing blocks for its next token; when
the pool runs out the newest running request is preempted (blocks freed, back to the front of
the waiting queue, recomputed on resumption). Then waiting requests are admitted in order,
while there is a sequence slot, room in this step's encoder batch and the encoder cache, and
blocks for their cross-attention and prompt. The queue is never skipped, so nothing starves; the
pool always holds one full-length request, so the oldest request always advances.
"""

from __future__ import annotations

import math
from collections import deque
from dataclasses import dataclass, field
from typing import TYPE_CHECKING

from asrserve.config import SchedulerConfig
from asrserve.engine.block_manager import BlockManager
from asrserve.engine.encoder_cache import EncoderCacheManager
from asrserve.engine.fallback import is_silence, needs_fallback, pick_attempt, summarize
from asrserve.engine.request import Attempt, Request, RequestOutput, RequestStatus
from asrserve.engine.word_timing import text_token_times
from asrserve.model.tokenizer import WhisperTokenizer

if TYPE_CHECKING:
    from asrserve.worker.sampler import SamplerOutput

__all__ = ["RequestOutput", "Scheduler", "SchedulerOutput"]


@dataclass
class SchedulerOutput:
    # Every request in this step's decoder forward, in batch order.
    scheduled: list[Request] = field(default_factory=list)
    # Requests admitted this step: their audio goes through one encoder forward and their
    # cross-attention K/V is written before the decoder runs.
    encoder_requests: list[Request] = field(default_factory=list)
    # Encoder outputs the runner may now drop (freed by the scheduler one step earlier).
    freed_encoder_ids: list[str] = field(default_factory=list)
    preempted: list[Request] = field(default_factory=list)

    @property
    def is_empty(self) -> bool:
        return not self.scheduled and not self.freed_encoder_ids


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        block_manager: BlockManager,
        encoder_cache: EncoderCacheManager,
        tokenizer: WhisperTokenizer,
        max_model_len: int,
    ):
        self.config = config
        self.block_manager = block_manager
        self.encoder_cache = encoder_cache
        self.tokenizer = tokenizer
        self.max_model_len = max_model_len  # decoder positions (448)
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_preemptions = 0
        max_request_blocks = block_manager.num_cross_blocks + math.ceil(max_model_len / block_manager.block_size)
        if block_manager.num_blocks < max_request_blocks:
            raise ValueError(
                f"a KV pool of {block_manager.num_blocks} blocks cannot hold one full-length request "
                f"({max_request_blocks} blocks of {block_manager.block_size} tokens): give it more blocks or memory"
            )

    def add(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(freed_encoder_ids=self.encoder_cache.take_freed())

        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING:
                continue  # preempted below to make room for an older request
            while not self.block_manager.can_grow(request):
                victim = self.running[-1]
                self._preempt(victim)
                output.preempted.append(victim)
                if victim is request:
                    break
            if request.status is RequestStatus.RUNNING:
                self.block_manager.grow(request)
                output.scheduled.append(request)

        # After a preemption the pool is tight: admitting now would only preempt again.
        while (
            not output.preempted
            and self.waiting
            and len(self.running) < self.config.max_num_seqs
            and len(output.encoder_requests) < self.config.max_encoder_batch
            and self.encoder_cache.num_free_slots > 0
            and self.block_manager.can_admit(self.waiting[0])
        ):
            request = self.waiting.popleft()
            self.block_manager.admit(request)
            self.encoder_cache.allocate(request.request_id)
            request.set_status(RequestStatus.RUNNING)
            self.running.append(request)
            output.encoder_requests.append(request)
            output.scheduled.append(request)
        return output

    def update(self, scheduler_output: SchedulerOutput, sampled: SamplerOutput) -> list[RequestOutput]:
        outputs = []
        for request in scheduler_output.encoder_requests:
            # Its cross-attention K/V is in its blocks now; the runner drops the encoder
            # output when the next schedule hands it this id.
            self.encoder_cache.free(request.request_id)
            request.cross_kv_written = True
        for index, (request, token_id, logprob) in enumerate(
            zip(scheduler_output.scheduled, sampled.token_ids, sampled.logprobs)
        ):
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted while the step ran
            request.num_computed_tokens = request.num_tokens
            if sampled.no_speech_probs and sampled.no_speech_probs[index] is not None:
                request.no_speech_prob = sampled.no_speech_probs[index]
            if request.needs_language:
                request.needs_language = False
                request.language = self.tokenizer.language_of(token_id)
                request.language_prob = math.exp(logprob)
                request.prompt_token_ids.extend(
                    self.tokenizer.task_tokens(request.language, request.task, request.sampling_params.timestamps)
                )
                outputs.append(RequestOutput(request.request_id, [], [], False, language=request.language))
                continue
            request.output_token_ids.append(token_id)
            request.output_logprobs.append(logprob)
            if request.sampling_params.word_timestamps:
                request.alignment_scores.append(sampled.alignment_scores[index])
            if token_id == self.tokenizer.special.eot:
                outputs.append(self._complete(request, "stop"))
            elif len(request.output_token_ids) >= request.max_tokens or request.num_tokens >= self.max_model_len:
                outputs.append(self._complete(request, "length"))
            else:
                outputs.append(
                    RequestOutput(request.request_id, [token_id], [logprob], False, None, request.language)
                )
        return outputs

    def _complete(self, request: Request, reason: str) -> RequestOutput:
        """A decode ended: retry it at the next fallback temperature, or finish the request
        with the attempt worth keeping."""
        params = request.sampling_params
        tokens, logprobs = request.output_token_ids, request.output_logprobs
        summary = summarize(
            tokens, logprobs, self.tokenizer.decode(tokens), request.temperature, request.no_speech_prob,
            self.tokenizer.special.eot,
        )
        attempt = Attempt(tokens, logprobs, summary, request.alignment_scores, reason)
        if request.fallback_temperatures and needs_fallback(summary, params):
            request.attempts.append(attempt)
            self._retry(request)
            return RequestOutput(request.request_id, [], [], False, None, request.language, restarted=True)

        attempts = [*request.attempts, attempt]
        chosen = attempt if len(attempts) == 1 else pick_attempt(attempts, params)
        summary = chosen.summary
        summary.num_attempts = len(attempts)
        summary.no_speech = is_silence(summary, params)
        if params.word_timestamps:
            summary.token_times = text_token_times(
                chosen.token_ids, chosen.alignment_scores, len(request.audio), self.tokenizer.special.eot
            )
        self._finish(request, RequestStatus.FINISHED, chosen.finish_reason)
        if chosen is attempt:  # the tokens already sent stand; this adds the last one
            return RequestOutput(
                request.request_id, tokens[-1:], logprobs[-1:], True, chosen.finish_reason, request.language,
                summary=summary,
            )
        return RequestOutput(
            request.request_id, chosen.token_ids, chosen.logprobs, True, chosen.finish_reason, request.language,
            restarted=True, summary=summary,
        )

    def _retry(self, request: Request) -> None:
        """Decodes again at the next temperature over the same cross-attention K/V and prompt
        K/V: the last prompt token is recomputed to get its logits back."""
        request.temperature = request.fallback_temperatures.pop(0)
        request.output_token_ids = []
        request.output_logprobs = []
        request.alignment_scores = []
        num_prompt = len(request.prompt_token_ids)
        self.block_manager.trim(request, num_prompt)
        request.num_computed_tokens = num_prompt - 1

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._finish(request, RequestStatus.ABORTED, "abort")
        return request

    def _finish(self, request: Request, status: RequestStatus, reason: str) -> None:
        if request.status is RequestStatus.RUNNING:
            self.running.remove(request)
        request.set_status(status)
        request.finish_reason = reason
        self.block_manager.free(request)
        self.encoder_cache.free(request.request_id)
        del self.requests[request.request_id]

    def _preempt(self, request: Request) -> None:
        """Frees everything the request holds; it resumes by recomputing encoder and tokens."""
        self.running.remove(request)
        self.block_manager.free(request)
        self.encoder_cache.free(request.request_id)
        request.num_computed_tokens = 0
        request.cross_kv_written = False
        request.num_preemptions += 1
        request.set_status(RequestStatus.WAITING)
        self.waiting.appendleft(request)
        self.num_preemptions += 1
