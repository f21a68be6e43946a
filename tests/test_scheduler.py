"""Scheduler, block manager and encoder cache on their own, with a simulated model."""

from __future__ import annotations

import random
from types import SimpleNamespace

import numpy as np
import pytest

from asrserve.config import SchedulerConfig
from asrserve.engine.block_manager import BlockManager
from asrserve.engine.encoder_cache import EncoderCacheManager
from asrserve.engine.request import Request, RequestStatus, SamplingParams
from asrserve.engine.scheduler import Scheduler
from asrserve.worker.sampler import SamplerOutput

EOT = 50256
SOT, NO_TIMESTAMPS = 50257, 50362
LANGUAGE_DE = 50261


class FakeTokenizer:
    special = SimpleNamespace(eot=EOT)

    def language_of(self, token_id: int) -> str:
        return {LANGUAGE_DE: "de"}[token_id]

    def task_tokens(self, language: str, task: str, timestamps: bool = False) -> list[int]:
        return [LANGUAGE_DE, 50359] + ([] if timestamps else [50363])

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(f"t{t}" for t in token_ids if t < EOT)


def make_request(request_id: str, max_tokens: int = 224, detect_language: bool = False) -> Request:
    prompt = [SOT] if detect_language else [SOT, NO_TIMESTAMPS]
    return Request(request_id, np.zeros(16000, np.float32), prompt, SamplingParams(), max_tokens,
                   detect_language=detect_language)


def make_scheduler(num_blocks=400, block_size=16, max_num_seqs=8, max_encoder_batch=4, encoder_cache_size=None):
    blocks = BlockManager(num_blocks, block_size, cross_len=1500)
    cache = EncoderCacheManager(encoder_cache_size or max_encoder_batch)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_encoder_batch=max_encoder_batch,
                             encoder_cache_size=encoder_cache_size)
    return Scheduler(config, blocks, cache, FakeTokenizer(), max_model_len=448)


def step(scheduler: Scheduler, token_for=lambda request: 1000):
    """One simulated step: the 'model' returns token_for(request) for every scheduled request."""
    output = scheduler.schedule()
    sampled = SamplerOutput([token_for(r) for r in output.scheduled], [-0.1] * len(output.scheduled))
    return output, scheduler.update(output, sampled)


# --- block manager ------------------------------------------------------------------------


def test_admission_reserves_cross_blocks_and_prompt_blocks():
    blocks = BlockManager(num_blocks=200, block_size=16, cross_len=1500)
    request = make_request("a")
    assert blocks.num_cross_blocks == 94
    blocks.admit(request)
    assert len(request.cross_block_table) == 94 and len(request.self_block_table) == 1
    assert blocks.num_free_blocks == 200 - 95
    assert not set(request.cross_block_table) & set(request.self_block_table)


def test_self_blocks_grow_with_tokens_and_free_is_idempotent():
    blocks = BlockManager(num_blocks=200, block_size=16, cross_len=1500)
    request = make_request("a")
    blocks.admit(request)
    request.output_token_ids = [1] * 14  # 16 tokens: still one block
    assert blocks.blocks_to_grow(request) == 0
    request.output_token_ids.append(1)  # the 17th token needs a second block
    assert blocks.blocks_to_grow(request) == 1
    blocks.grow(request)
    assert len(request.self_block_table) == 2
    blocks.free(request)
    blocks.free(request)
    assert blocks.num_free_blocks == 200
    assert request.self_block_table == [] and request.cross_block_table == []


def test_admission_fails_when_blocks_do_not_fit():
    blocks = BlockManager(num_blocks=150, block_size=16, cross_len=1500)
    first, second = make_request("a"), make_request("b")
    blocks.admit(first)
    assert not blocks.can_admit(second)
    blocks.free(first)
    assert blocks.can_admit(second)


# --- encoder cache ------------------------------------------------------------------------


def test_encoder_cache_frees_one_step_late_and_never_leaks():
    scheduler = make_scheduler()
    for name in "abc":
        scheduler.add(make_request(name))
    output, _ = step(scheduler)
    assert [r.request_id for r in output.encoder_requests] == ["a", "b", "c"]
    assert output.freed_encoder_ids == []
    # Consumed in that step: freed by the scheduler, but handed to the runner only now.
    assert scheduler.encoder_cache.num_cached == 0
    assert scheduler.encoder_cache.num_pending_frees == 3
    output, _ = step(scheduler)
    assert sorted(output.freed_encoder_ids) == ["a", "b", "c"]
    assert scheduler.encoder_cache.num_pending_frees == 0
    output, _ = step(scheduler)
    assert output.freed_encoder_ids == [], "each id is handed over once"


def test_encoder_cache_capacity_limits_admissions():
    scheduler = make_scheduler(max_encoder_batch=4, encoder_cache_size=2)
    for name in "abcd":
        scheduler.add(make_request(name))
    output, _ = step(scheduler)
    assert len(output.encoder_requests) == 2


def test_encoder_cache_free_is_idempotent():
    cache = EncoderCacheManager(2)
    cache.allocate("a")
    cache.free("a")
    cache.free("a")
    cache.free("never-allocated")
    assert cache.num_cached == 0 and cache.take_freed() == ["a"]


# --- scheduling ---------------------------------------------------------------------------


def test_fcfs_with_sequence_and_encoder_limits():
    scheduler = make_scheduler(max_num_seqs=3, max_encoder_batch=2)
    for i in range(5):
        scheduler.add(make_request(f"r{i}"))
    output, _ = step(scheduler)
    assert [r.request_id for r in output.encoder_requests] == ["r0", "r1"]
    output, _ = step(scheduler)
    assert [r.request_id for r in output.encoder_requests] == ["r2"]  # max_num_seqs reached
    assert [r.request_id for r in output.scheduled] == ["r0", "r1", "r2"]
    assert [r.request_id for r in scheduler.waiting] == ["r3", "r4"]


def test_new_requests_join_running_ones_in_one_decoder_step():
    scheduler = make_scheduler(max_encoder_batch=1)
    scheduler.add(make_request("a"))
    step(scheduler)
    scheduler.add(make_request("b"))
    output = scheduler.schedule()
    assert [r.request_id for r in output.scheduled] == ["a", "b"]
    assert [r.num_new_tokens for r in output.scheduled] == [1, 2]  # a's last token, b's prompt


def test_waiting_queue_is_not_skipped():
    """If the head of the queue does not fit, nothing behind it jumps ahead (no starvation)."""
    scheduler = make_scheduler(num_blocks=200, block_size=16)  # 105 free once "a" runs
    scheduler.add(make_request("a"))
    step(scheduler)
    big = make_request("big")
    big.prompt_token_ids = [SOT] + [1] * 300  # needs 94 + 19 blocks: does not fit now
    scheduler.add(big)
    scheduler.add(make_request("small"))  # would fit
    output, _ = step(scheduler)
    assert output.encoder_requests == []
    assert [r.request_id for r in scheduler.waiting] == ["big", "small"]


def test_preemption_takes_the_newest_and_requeues_it_first():
    # Three admitted (3 * 95 blocks), one spare: the first to need a second block takes the
    # spare, the next forces a preemption of the newest.
    scheduler = make_scheduler(num_blocks=3 * 95 + 1, block_size=16)
    for name in "abc":
        scheduler.add(make_request(name))
    scheduler.add(make_request("d"))
    output, _ = step(scheduler)
    assert [r.request_id for r in output.encoder_requests] == ["a", "b", "c"]
    preempted = []
    for _ in range(20):
        output, _ = step(scheduler)
        preempted += [r.request_id for r in output.preempted]
        if preempted:
            break
    assert preempted == ["c"]
    victim = scheduler.requests["c"]
    assert victim.status is RequestStatus.WAITING and victim.num_preemptions == 1
    assert victim.num_computed_tokens == 0 and victim.self_block_table == [] and victim.cross_block_table == []
    assert len(victim.output_token_ids) > 0, "its outputs are kept and recomputed on resumption"
    assert [r.request_id for r in scheduler.waiting] == ["c", "d"]


def test_no_deadlock_and_no_starvation_under_random_lengths():
    rng = random.Random(7)
    scheduler = make_scheduler(num_blocks=3 * 375 + 20, block_size=4, max_num_seqs=16, max_encoder_batch=8)
    lengths = {}
    for i in range(40):
        request = make_request(f"r{i}")
        lengths[request.request_id] = rng.randint(1, 200)
        scheduler.add(request)
    finish_order = []
    for _ in range(10_000):
        if not scheduler.has_unfinished_requests():
            break
        _, outputs = step(scheduler, lambda r: EOT if len(r.output_token_ids) + 1 >= lengths[r.request_id] else 1000)
        finish_order += [o.request_id for o in outputs if o.finished]
        assert scheduler.block_manager.num_free_blocks >= 0
    assert not scheduler.has_unfinished_requests(), "every request finishes"
    assert scheduler.num_preemptions > 0
    assert sorted(finish_order) == sorted(lengths)
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
    assert scheduler.encoder_cache.num_cached == 0


def test_stop_and_length_finish_reasons():
    scheduler = make_scheduler()
    scheduler.add(make_request("stops"))
    scheduler.add(make_request("long", max_tokens=3))
    reasons = {}
    for _ in range(5):
        _, outputs = step(scheduler, lambda r: EOT if r.request_id == "stops" else 1000)
        reasons |= {o.request_id: o.finish_reason for o in outputs if o.finished}
    assert reasons == {"stops": "stop", "long": "length"}
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks


def test_decoder_context_is_never_exceeded():
    scheduler = make_scheduler()
    request = make_request("ctx", max_tokens=10_000)
    scheduler.add(request)
    while scheduler.has_unfinished_requests():
        step(scheduler)
    assert request.num_tokens == 448 and request.finish_reason == "length"


def test_language_detection_step_extends_the_prompt():
    scheduler = make_scheduler()
    request = make_request("multi", detect_language=True)
    scheduler.add(request)
    output, outputs = step(scheduler, lambda r: LANGUAGE_DE if r.needs_language else 1000)
    assert outputs[0].language == "de" and outputs[0].new_token_ids == []
    assert request.prompt_token_ids == [SOT, LANGUAGE_DE, 50359, 50363]
    assert request.num_new_tokens == 3, "the language and task tokens go into the next step"
    output, outputs = step(scheduler)
    assert output.encoder_requests == [] and outputs[0].new_token_ids == [1000]


def test_abort_frees_waiting_and_running_requests():
    scheduler = make_scheduler(max_encoder_batch=1)
    scheduler.add(make_request("running"))
    scheduler.add(make_request("waiting"))
    step(scheduler)
    assert scheduler.abort("running").status is RequestStatus.ABORTED
    assert scheduler.abort("waiting").finish_reason == "abort"
    assert scheduler.abort("running") is None
    assert scheduler.block_manager.num_free_blocks == scheduler.block_manager.num_blocks
    assert not scheduler.has_unfinished_requests()


def test_request_state_machine_rejects_bad_transitions():
    request = make_request("a")
    request.set_status(RequestStatus.RUNNING)
    request.set_status(RequestStatus.WAITING)  # preempted
    request.set_status(RequestStatus.RUNNING)
    request.set_status(RequestStatus.FINISHED)
    with pytest.raises(AssertionError):
        request.set_status(RequestStatus.RUNNING)


def test_sampling_params_are_validated():
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=-1)
    with pytest.raises(ValueError, match="temperature"):
        SamplingParams(temperature=float("nan"))
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
