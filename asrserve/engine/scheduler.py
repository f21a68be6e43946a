"""Continuous batching: which sequences the next step's encoder and decoder forwards cover.

A request is one sequence until it needs more: best_of samples, or its fallback temperatures
once its first decode fails (DecodeGroup). Siblings are sequences in the running list (they
count against max_num_seqs and grow blocks like any other) that share the request's
cross-attention and prompt blocks. A request whose own sample is done while siblings decode is
parked: out of the batch, holding its shared blocks.

FCFS within two classes: a live session's decodes (interactive; a turn's final decode first)
before file work, which keeps a steady share; engine.waiting_queue also sets the encoder
batch (one audio on CPU while live decodes run). Running sequences come first, oldest first,
each needing blocks for its next token; when the pool runs out, the newest file request's
newest sibling is dropped (its sample starts again later), or one without siblings is
preempted (blocks freed, back to the front of its class, recomputed on resumption). Then
siblings start for requests with samples waiting, oldest first; then waiting requests are
admitted in order while there is a sequence slot, room in this step's encoder batch and the
encoder cache, blocks for their cross-attention and prompt, and (file work beside streamed
decodes) the encoder's share of time (waiting_queue). A class's queue is skipped only by
first pieces, for at most a second; the pool always holds one full-length sequence, so the oldest
request always advances. A greedy request given a draft (engine/draft.py) checks several of its
guessed tokens in one step and takes as many as the decode agrees with."""

from __future__ import annotations

import itertools
import math
import random
from typing import TYPE_CHECKING

from asrserve.config import SchedulerConfig
from asrserve.engine.block_manager import BlockManager
from asrserve.engine.encoder_cache import EncoderCacheManager
from asrserve.engine.decode_group import LEVELS_AHEAD_UNDER_LOAD, DecodeGroup
from asrserve.engine.draft import DraftCounts, attach, can_check, detach
from asrserve.engine.fallback import is_looping, is_silence, summarize
from asrserve.engine.request import UNSURE_LANGUAGE_PROBABILITY, Attempt, Request, RequestOutput, RequestStatus
from asrserve.engine.scheduler_output import SchedulerOutput
from asrserve.engine.waiting_queue import WaitingQueue
from asrserve.engine.word_timing import text_token_times
from asrserve.model.tokenizer import WhisperTokenizer

if TYPE_CHECKING:
    from asrserve.worker.sampler import SamplerOutput

__all__ = ["RequestOutput", "Scheduler", "SchedulerOutput"]


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
        self.waiting = WaitingQueue(config.batch_admit_interval_s, encoder_time_share=config.encoder_time_share or 1.0)
        self.running: list[Request] = []  # requests and siblings in the decoder batch
        self.parked: list[Request] = []  # requests whose own sample is done, siblings decoding
        self.requests: dict[str, Request] = {}  # by the caller's id (siblings are not here)
        self.num_preemptions = 0
        self.drafts = DraftCounts()
        self._arrivals = itertools.count()
        self._sibling_numbers = itertools.count()
        block_manager.check_holds_one_request(max_model_len)

    def add(self, request: Request) -> None:
        assert request.request_id not in self.requests, f"duplicate request id {request.request_id}"
        params = request.sampling_params
        # Temperature 0 samples only in fallback: a fixed seed keeps a greedy request
        # reproducible. An explicit temperature without a seed is random.
        seed = params.seed
        if seed is None:
            seed = 0 if params.temperature == 0 else random.getrandbits(62)
        request.group = DecodeGroup(params, seed)
        request.order = next(self._arrivals)
        self._start_sample(request, (0, 0))
        self.requests[request.request_id] = request
        self.waiting.append(request)

    def has_unfinished_requests(self) -> bool:
        return bool(self.waiting or self.running or self.parked)

    def schedule(self) -> SchedulerOutput:
        output = SchedulerOutput(freed_encoder_ids=self.encoder_cache.take_freed())
        self.waiting.step_started()
        sit_out = self.config.finals_alone and self.waiting.batch_sits_out(self.running)  # file work (waiting_queue)
        # A sequence let go (preempted: waiting; dropped sibling: aborted) is no longer RUNNING.
        for request in list(self.running):
            if request.status is not RequestStatus.RUNNING or (sit_out and not request.interactive):
                continue  # made room for an older request below, or sits out
            if not self.block_manager.blocks_to_grow(request):  # most steps: the last block has room
                output.scheduled.append(request)
                continue
            while not self.block_manager.can_grow(request):
                victim = self._make_room(output)
                if victim is request or request.status is not RequestStatus.RUNNING:
                    break
            if request.status is RequestStatus.RUNNING:
                self.block_manager.grow(request)
                output.scheduled.append(request)

        # After a preemption the pool is tight: starting more would only preempt again. What
        # was let go may have been scheduled before a sibling further down needed its blocks.
        if output.preempted:
            output.scheduled = [r for r in output.scheduled if r.status is RequestStatus.RUNNING]
            return output
        for request in output.scheduled:
            if can_check(request):  # a live decode's guess at its next tokens (draft.py)
                attach(request, self.block_manager, self.max_model_len)
        # Usually none: only fallback or best_of has samples waiting (alone: all levels at once).
        primaries = [r for r in (*self.running, *self.parked) if not r.is_sibling]
        levels_ahead = None if len(primaries) + len(self.waiting) == 1 else LEVELS_AHEAD_UNDER_LOAD
        for request in primaries:
            request.group.levels_ahead = levels_ahead
        pending = [r for r in primaries if r.group.next_unassigned() is not None]
        for request in sorted(pending, key=lambda r: r.order):
            while (request.interactive or not sit_out) and self._can_start_sibling(request):
                sibling = self._start_sibling(request)
                output.scheduled.append(sibling)
        interactive_running = any(r.interactive for r in self.running)
        encoder_budget = self.waiting.encoder_budget(interactive_running, self.config)
        if not self.waiting:
            return output
        urgent_running = any(r.urgent for r in self.running)  # (admissions only, not every step)
        decodes = len(output.scheduled)  # (those before this step's admissions; scanned only if needed)
        streaming = lambda: WaitingQueue.streams_text(itertools.islice(output.scheduled, decodes))  # noqa: E731
        while (
            (request := self.waiting.next_admissible(interactive_running, urgent_running, streaming)) is not None
            and len(self.running) < self.config.max_num_seqs
            and len(output.encoder_requests) < encoder_budget
            and self.encoder_cache.num_free_slots > 0
            and self.block_manager.can_admit(request)
        ):
            self.waiting.pop(request)
            self.block_manager.admit(request)
            self.encoder_cache.allocate(request.request_id)
            request.set_status(RequestStatus.RUNNING)
            self.running.append(request)
            output.encoder_requests.append(request)
            output.scheduled.append(request)
            interactive_running |= request.interactive
            urgent_running |= request.urgent
        return output

    def update(self, scheduler_output: SchedulerOutput, sampled: SamplerOutput) -> list[RequestOutput]:
        outputs = []
        self.waiting.step_finished()
        for request in scheduler_output.encoder_requests:
            # Its cross-attention K/V is in its blocks: the next schedule tells the runner to drop it.
            self.encoder_cache.free(request.request_id)
            request.cross_kv_written = True
        no_speech_probs = sampled.no_speech_probs  # below: Python per sequence and step, kept lean
        for index, (request, token_id, logprob) in enumerate(
            zip(scheduler_output.scheduled, sampled.token_ids, sampled.logprobs)
        ):
            proposal = detach(request) if request.num_draft_tokens else []
            if request.status is not RequestStatus.RUNNING:
                continue  # aborted, or dropped as a sibling, while the step ran
            request.num_computed_tokens = request.num_tokens
            if no_speech_probs and no_speech_probs[index] is not None:
                request.no_speech_prob = no_speech_probs[index]
            if request.needs_language:
                language, probability = self.tokenizer.language_of(token_id), math.exp(logprob)
                if probability < UNSURE_LANGUAGE_PROBABILITY and request.sampling_params.language_if_unsure:
                    language = request.sampling_params.language_if_unsure
                task_tokens = self.tokenizer.task_tokens(language, request.task, request.sampling_params.timestamps)
                if request.set_detected_language(language, probability, task_tokens):
                    self.block_manager.trim(request, 0)  # computed again, the previous text first
                outputs.append(RequestOutput(request.request_id, [], [], False, language=request.language,
                                             language_probability=probability))
                continue
            if not proposal and not request.draft_token_ids:  # one new token, no draft to move
                alignment = sampled.alignment_scores[index] if request.sampling_params.word_timestamps else None
                outputs += self._append(request, token_id, logprob, alignment)[1]
                continue
            for token, token_logprob, alignment in self.drafts.settle(request, proposal, sampled, index):
                request.num_computed_tokens = request.num_tokens  # a kept draft token's K/V is computed
                finished, token_outputs = self._append(request, token, token_logprob, alignment)
                outputs.extend(token_outputs)
                if finished:
                    break
        return outputs

    def _append(self, request: Request, token_id: int, logprob: float, alignment) -> tuple[bool, list[RequestOutput]]:
        """One new output token: whether it ended the sample, and what to send."""
        request.output_token_ids.append(token_id)
        request.output_logprobs.append(logprob)
        if request.sampling_params.word_timestamps:
            request.alignment_scores.append(alignment)
        eot = self.tokenizer.special.eot
        if token_id == eot:
            return True, self._complete(request, "stop")
        if request.at_length_limit(self.max_model_len, eot):
            return True, self._complete(request, "length")
        if is_looping(request, self.tokenizer):  # cut short: if kept, the rest is read again
            return True, self._complete(request, "repetition")
        if request.sends_token:
            request.text_started |= token_id < eot
            return False, [RequestOutput(request.request_id, [token_id], [logprob], False, None, request.language)]
        return False, []

    def _complete(self, sequence: Request, reason: str) -> list[RequestOutput]:
        """A sample finished: record it, and finish the request if that decides it, or give
        the sequence the next sample (a sibling with none left goes, a request parks)."""
        request = sequence.primary or sequence
        group = request.group
        params = request.sampling_params
        tokens, logprobs = sequence.output_token_ids, sequence.output_logprobs
        summary = summarize(
            tokens, logprobs, self.tokenizer.decode(tokens), sequence.temperature, request.no_speech_prob,
            self.tokenizer.special.eot,
        )
        attempt = Attempt(tokens, logprobs, summary, sequence.alignment_scores, reason)
        streamed = sequence.streams_tokens
        chosen = group.record(sequence.sample_key, attempt)
        if chosen is None:
            key = group.next_unassigned()
            if sequence.is_sibling:
                self._drop_sibling(sequence)
            elif key is not None:
                self._restart(sequence, key)
            else:  # parked with what its siblings read: its sample's own blocks would starve theirs
                self.running.remove(sequence)
                self.parked.append(sequence)
                self.block_manager.keep_shared_only(sequence)
            return []

        summary = chosen.summary
        summary.num_attempts = len(group.finished)
        summary.no_speech = is_silence(summary, params)
        if params.word_timestamps:
            summary.token_times = text_token_times(
                chosen.token_ids, chosen.alignment_scores, len(request.audio), self.tokenizer.special.eot
            )
        self._finish(request, RequestStatus.FINISHED, chosen.finish_reason)
        if chosen is attempt and streamed:  # the tokens already sent stand; this adds the last one
            return [RequestOutput(
                request.request_id, tokens[-1:], logprobs[-1:], True, chosen.finish_reason, request.language,
                summary=summary,
            )]
        return [RequestOutput(
            request.request_id, chosen.token_ids, chosen.logprobs, True, chosen.finish_reason, request.language,
            restarted=True, summary=summary,
        )]

    # --- samples and siblings -----------------------------------------------------------

    def _start_sample(self, sequence: Request, key: tuple[int, int]) -> None:
        group = (sequence.primary or sequence).group
        group.assign(key)
        sequence.sample_key = key
        sequence.temperature, sequence.sample_seed, sequence.generator = group.temperature(key), group.seed(key), None
        sequence.output_token_ids, sequence.output_logprobs, sequence.alignment_scores = [], [], []

    def _restart(self, request: Request, key: tuple[int, int]) -> None:
        """The request decodes another sample over the same cross-attention K/V and prompt
        K/V: the last prompt token is recomputed to get its logits back."""
        self._start_sample(request, key)
        self.block_manager.keep_prompt_only(request)

    def _can_start_sibling(self, request: Request) -> bool:
        if not request.cross_kv_written or request.needs_language or request.group.next_unassigned() is None:
            return False
        return len(self.running) < self.config.max_num_seqs and self.block_manager.can_start_sibling(request)

    def _start_sibling(self, request: Request) -> Request:
        """A new sequence for the request's next unassigned sample, reading its cross-attention
        and prompt blocks and computing only the prompt's last block itself."""
        key = request.group.next_unassigned()
        sibling = request.new_sibling(f"{request.request_id}/sample-{next(self._sibling_numbers)}")
        shared = self.block_manager.shareable_tokens(request)
        self.block_manager.share(request, sibling, shared)
        sibling.num_computed_tokens = shared
        self.block_manager.grow(sibling)
        sibling.set_status(RequestStatus.RUNNING)
        self._start_sample(sibling, key)
        self.running.append(sibling)
        return sibling

    def _siblings(self, request: Request) -> list[Request]:
        return [sequence for sequence in self.running if sequence.primary is request]

    def _drop_sibling(self, sibling: Request) -> None:
        """The sibling stops; its blocks go (shared ones stay with the request), and its
        sample, if unfinished, is decoded again later."""
        sibling.primary.group.unassign(sibling.sample_key)
        self.running.remove(sibling)
        self.block_manager.free(sibling)
        sibling.set_status(RequestStatus.ABORTED)

    def _make_room(self, output: SchedulerOutput) -> Request:
        """Frees blocks for an older sequence: the newest request's newest sibling goes, or,
        without siblings, the newest request is preempted; file work goes before a live
        session's decode, an interim before a final. Returns what was let go."""
        candidates = self.running + self.parked
        newest = candidates[max(range(len(candidates)), key=lambda i: (
            not candidates[i].interactive, not candidates[i].urgent, candidates[i].order, candidates[i].is_sibling, i))]
        output.preempted.append(newest)
        if newest.is_sibling:
            self._drop_sibling(newest)
        else:
            self._preempt(newest)
        return newest

    def abort(self, request_id: str) -> Request | None:
        request = self.requests.get(request_id)
        if request is None:
            return None
        if request.status is RequestStatus.WAITING:
            self.waiting.remove(request)
        self._finish(request, RequestStatus.ABORTED, "abort")
        return request

    def _finish(self, request: Request, status: RequestStatus, reason: str) -> None:
        for sibling in self._siblings(request):
            self._drop_sibling(sibling)
        if request in self.running:
            self.running.remove(request)
        elif request in self.parked:
            self.parked.remove(request)
        request.set_status(status)
        request.finish_reason = reason
        self.block_manager.free(request)
        self.encoder_cache.free(request.request_id)
        del self.requests[request.request_id]

    def _preempt(self, request: Request) -> None:
        """Frees everything the request holds, its siblings included; it resumes by recomputing
        encoder and tokens. A parked request resumes on an unfinished sample of its own."""
        for sibling in self._siblings(request):
            self._drop_sibling(sibling)
        if request in self.parked:
            self.parked.remove(request)
            self._start_sample(request, request.group.next_unassigned())
        else:
            self.running.remove(request)
        self.block_manager.free(request)
        self.encoder_cache.free(request.request_id)
        request.num_computed_tokens = 0
        request.cross_kv_written = False
        request.num_preemptions += 1
        request.set_status(RequestStatus.WAITING)
        self.waiting.appendleft(request)
        self.num_preemptions += 1
