"""Scheduler, block manager and encoder cache on their own, with a simulated model."""

from __future__ import annotations

import math
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
LANGUAGE_DE, LANGUAGE_FR = 50261, 50265
LANGUAGE_TOKENS = {"de": LANGUAGE_DE, "fr": LANGUAGE_FR}


TIMESTAMP_BEGIN = 50364


class FakeTokenizer:
    special = SimpleNamespace(eot=EOT, timestamp_begin=TIMESTAMP_BEGIN)

    def language_of(self, token_id: int) -> str:
        return {token: language for language, token in LANGUAGE_TOKENS.items()}[token_id]

    def task_tokens(self, language: str, task: str, timestamps: bool = False) -> list[int]:
        return [LANGUAGE_TOKENS[language], 50359] + ([] if timestamps else [50363])

    def decode(self, token_ids: list[int]) -> str:
        return " ".join(f"t{t}" for t in token_ids if t < EOT)


def make_request(request_id: str, max_tokens: int = 224, detect_language: bool = False,
                 params: SamplingParams | None = None, prompt: list[int] | None = None) -> Request:
    prompt = prompt or ([SOT] if detect_language else [SOT, NO_TIMESTAMPS])
    return Request(request_id, np.zeros(16000, np.float32), prompt, params or SamplingParams(), max_tokens,
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


def test_cross_blocks_are_aligned_slots_taken_lowest_first_and_self_blocks_come_from_the_top():
    blocks = BlockManager(num_blocks=3 * 94 + 10, block_size=16, cross_len=1500)
    assert blocks.num_cross_slots == 3
    first, second, third = make_request("a"), make_request("b"), make_request("c")
    for request in (first, second):
        blocks.admit(request)
    assert first.cross_block_table == list(range(94)) and second.cross_block_table == list(range(94, 188))
    assert first.self_block_table == [3 * 94 + 9] and second.self_block_table == [3 * 94 + 8]
    assert [r.cross_slot for r in (first, second)] == [0, 1]
    blocks.free(first)
    blocks.admit(third)  # the lowest free slot again
    assert third.cross_slot == 0


def test_a_slot_is_free_only_when_all_its_blocks_are():
    """Self blocks spill into the slot region once the top is used up. A slot holding one of
    them cannot be admitted into, though enough blocks are free in number."""
    blocks = BlockManager(num_blocks=3 * 94 + 4, block_size=16, cross_len=1500)  # top: 282-285
    first, second, third, fourth = (make_request(name) for name in "abcd")
    blocks.admit(first)
    blocks.admit(second)
    second.output_token_ids = [1] * 40  # three self blocks: the top is used up
    blocks.grow(second)
    first.output_token_ids = [1] * 16  # a second self block, from slot 2
    blocks.grow(first)
    assert first.self_block_table == [285, 281] and second.self_block_table == [284, 283, 282]
    blocks.free(second)
    blocks.admit(third)
    assert third.cross_slot == 1
    assert blocks.num_free_blocks == blocks.blocks_to_admit(fourth) and not blocks.can_admit(fourth)
    blocks.trim(first, 2)  # block 281 goes back: slot 2 is whole again
    blocks.admit(fourth)
    assert fourth.cross_slot == 2
    for request in (first, third, fourth):
        blocks.free(request)
    assert blocks.num_free_blocks == blocks.num_blocks
    assert all(blocks.ref_count(b) == 0 for b in range(blocks.num_blocks))


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


@pytest.mark.parametrize("finals_alone", [True, False])
def test_file_sequences_sit_out_a_final_decodes_steps_where_told(finals_alone):
    """finals_alone (CPU's default): while a live turn's final decode runs, running file
    sequences (and their fallback samples) sit out its steps; interims and the final decode.
    Once it is done they decode again, and they lose nothing meanwhile."""
    scheduler = make_scheduler(max_encoder_batch=4)
    scheduler.config.finals_alone = finals_alone
    scheduler.add(make_request("file", max_tokens=20))
    step(scheduler)
    for request_id, urgent in (("interim", False), ("final", True)):
        request = make_request(request_id, max_tokens=3)
        request.interactive, request.urgent = True, urgent
        scheduler.add(request)
    output, _ = step(scheduler)
    assert [r.request_id for r in output.scheduled] == ["file", "final"]  # (interims wait behind a final)
    file = scheduler.requests["file"]
    tokens = len(file.output_token_ids)
    output, _ = step(scheduler)
    assert [r.request_id for r in output.scheduled] == (["final"] if finals_alone else ["file", "final"])
    assert len(file.output_token_ids) == tokens + (0 if finals_alone else 1)
    while "final" in scheduler.requests:
        step(scheduler)
    output, _ = step(scheduler)
    assert "file" in [r.request_id for r in output.scheduled] and file.status is RequestStatus.RUNNING


def test_file_sequences_sit_out_from_when_they_run_beside_a_final():
    """The sit-out's second counts from when file work runs beside a final: a final alone for
    seconds (live sessions only) used it up, and the first file request admitted beside it did
    not sit out at all."""
    scheduler = make_scheduler(max_encoder_batch=4)
    scheduler.config.finals_alone = True
    now = [0.0]
    scheduler.waiting.clock = lambda: now[0]
    final = make_request("final", max_tokens=200)
    final.interactive = final.urgent = True
    scheduler.add(final)
    scheduler.add(make_request("file", max_tokens=20))
    admitted = None
    for _ in range(40):
        now[0] += 0.05
        output, _ = step(scheduler)
        if "file" in [r.request_id for r in output.encoder_requests]:
            admitted = now[0]  # held while the final decodes, at most MAX_URGENT_HOLD_S
            break
    assert admitted is not None and admitted > 1.0
    now[0] += 0.05
    output, _ = step(scheduler)
    assert [r.request_id for r in output.scheduled] == ["final"]


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


def test_an_unsure_detection_gives_way_to_the_language_given_for_that():
    """A continuation detects its language again (the rest of a piece may be in another one,
    after a switch) but keeps its piece's where the detection is unsure: a few seconds of
    speech can look like another language."""
    for probability, fallback, expected in ((0.3, "fr", "fr"), (0.8, "fr", "de"), (0.3, None, "de")):
        scheduler = make_scheduler()
        request = make_request("c", detect_language=True, params=SamplingParams(language_if_unsure=fallback))
        scheduler.add(request)
        output = scheduler.schedule()
        outputs = scheduler.update(output, SamplerOutput([LANGUAGE_DE], [math.log(probability)]))
        assert outputs[0].language == request.language == expected
        assert request.prompt_token_ids[1] == LANGUAGE_TOKENS[expected]


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


# --- fallback and best_of: sibling sequences -----------------------------------------------

FALLBACK = (0.2, 0.4, 0.6, 0.8, 1.0)


def step_model(scheduler: Scheduler, model):
    """One simulated step where model(sequence) returns (token, logprob) for each sequence."""
    output = scheduler.schedule()
    chosen = [model(r) for r in output.scheduled]
    sampled = SamplerOutput([t for t, _ in chosen], [lp for _, lp in chosen])
    return output, scheduler.update(output, sampled)


def run_to_end(scheduler: Scheduler, model, max_steps: int = 5000):
    outputs, sequences = [], []
    for _ in range(max_steps):
        if not scheduler.has_unfinished_requests():
            break
        _, step_outputs = step_model(scheduler, model)
        outputs += step_outputs
        sequences.append(len(scheduler.running))
    assert not scheduler.has_unfinished_requests()
    return outputs, sequences


def assert_nothing_held(scheduler: Scheduler) -> None:
    blocks = scheduler.block_manager
    assert blocks.num_free_blocks == blocks.num_blocks
    assert all(blocks.ref_count(b) == 0 for b in range(blocks.num_blocks))
    assert scheduler.encoder_cache.num_cached == 0 and not scheduler.running and not scheduler.parked


def fails_until(passing: float, length_by_temperature=None):
    """A model whose samples at `passing` and above are likely, below unlikely; each sample
    ends after length_by_temperature[t] tokens (default 5)."""
    lengths = length_by_temperature or {}

    def model(sequence):
        done = len(sequence.output_token_ids) + 1 >= lengths.get(sequence.temperature, 5)
        return (EOT if done else 1000 + len(sequence.output_token_ids)), (-0.1 if sequence.temperature >= passing else -3.0)
    return model


def test_fallback_temperatures_decode_at_once_over_shared_blocks():
    scheduler = make_scheduler()
    request = make_request("a", params=SamplingParams(fallback_temperatures=FALLBACK))
    scheduler.add(request)
    model = fails_until(passing=9.0)  # every sample fails
    for _ in range(5):  # the greedy decode, alone
        output, outputs = step_model(scheduler, model)
        assert len(output.scheduled) == 1
    output = scheduler.schedule()
    # The request decodes the first fallback temperature itself; four siblings the others.
    assert sorted(r.temperature for r in output.scheduled) == list(FALLBACK)
    siblings = [r for r in output.scheduled if r.is_sibling]
    assert len(siblings) == 4 and all(s.primary is request for s in siblings)
    blocks = scheduler.block_manager
    for block_id in request.cross_block_table:
        assert blocks.ref_count(block_id) == 5
    assert all(s.cross_block_table == request.cross_block_table for s in siblings)
    scheduler.update(output, SamplerOutput([1000] * 5, [-3.0] * 5))
    outputs, _ = run_to_end(scheduler, model)
    final = outputs[-1]
    assert final.finished and final.restarted and final.summary.num_attempts == 6
    assert_nothing_held(scheduler)


def test_beside_other_requests_fallback_opens_two_levels_at_a_time_with_the_same_outcome():
    """Alone, every fallback level opens when the greedy decode fails (the test above); beside
    another request only LEVELS_AHEAD_UNDER_LOAD levels past the lowest undecided one decode,
    the next opening as one fails, and the request ends as it would alone."""
    from asrserve.engine.decode_group import LEVELS_AHEAD_UNDER_LOAD

    lengths = {0.0: 3, 0.2: 4, 0.4: 6, 0.6: 5, 0.8: 5, 1.0: 5}
    model = fails_until(passing=0.6, length_by_temperature=lengths)
    alone = make_scheduler()
    alone.add(make_request("a", params=SamplingParams(fallback_temperatures=FALLBACK)))
    alone_final = run_to_end(alone, model)[0][-1]
    scheduler = make_scheduler()
    scheduler.add(make_request("a", params=SamplingParams(fallback_temperatures=FALLBACK)))
    scheduler.add(make_request("other", max_tokens=40))  # runs beside it
    temperatures_per_step, outputs = [], []
    while scheduler.has_unfinished_requests():
        output, step_outputs = step_model(scheduler, lambda r: (1000, -0.1) if r.request_id == "other" else model(r))
        temperatures_per_step.append(sorted(r.temperature for r in output.scheduled if (r.primary or r).request_id == "a"))
        outputs += [o for o in step_outputs if o.request_id == "a"]
    final = outputs[-1]
    assert final.finished and final.summary.temperature == alone_final.summary.temperature == 0.6
    assert final.new_token_ids == alone_final.new_token_ids
    assert max(len(t) for t in temperatures_per_step) == LEVELS_AHEAD_UNDER_LOAD
    # 0.2 and 0.4 first (the sibling a step after the request's own restart, as alone); 0.6
    # once 0.2 has failed (beside 0.4); 0.8 only once 0.4 has failed too
    assert [0.2, 0.4] in temperatures_per_step and [0.4, 0.6] in temperatures_per_step
    first = {t: next(i for i, ts in enumerate(temperatures_per_step) if t in ts) for t in (0.2, 0.4, 0.6, 0.8)}
    assert first[0.2] + 1 == first[0.4] < first[0.6] < first[0.8]
    assert_nothing_held(scheduler)


def test_the_first_passing_temperature_in_order_wins():
    # 0.4 and 0.6 both pass; 0.6 finishes first, 0.4 later, 0.8 and 1.0 would run long.
    lengths = {0.0: 3, 0.2: 6, 0.4: 12, 0.6: 4, 0.8: 200, 1.0: 200}
    scheduler = make_scheduler()
    scheduler.add(make_request("a", params=SamplingParams(fallback_temperatures=FALLBACK)))
    outputs, sequences = run_to_end(scheduler, fails_until(passing=0.4, length_by_temperature=lengths))
    final = outputs[-1]
    assert final.summary.temperature == 0.4 and len(final.new_token_ids) == 12
    assert final.summary.num_attempts == 4  # 0, 0.2, 0.6 and 0.4 finished; 0.8 and 1.0 dropped
    assert len(sequences) < 3 + 12 + 2, "the long samples were dropped once 0.4 decided"
    assert_nothing_held(scheduler)


def test_a_passing_greedy_decode_starts_no_sibling():
    scheduler = make_scheduler()
    scheduler.add(make_request("a", params=SamplingParams(fallback_temperatures=FALLBACK, best_of=5)))
    outputs, sequences = run_to_end(scheduler, fails_until(passing=0.0))
    assert max(sequences) == 1 and not any(o.restarted for o in outputs)
    assert [t for o in outputs for t in o.new_token_ids] == [1000, 1001, 1002, 1003, EOT]


def test_best_of_keeps_the_likeliest_sample_and_counts_against_max_num_seqs():
    scheduler = make_scheduler(max_num_seqs=3)
    request = make_request("a", params=SamplingParams(temperature=0.7, best_of=4, seed=3))

    def model(sequence):  # sample 2 is the likeliest
        done = len(sequence.output_token_ids) + 1 >= 4
        return (EOT if done else 1000 + sequence.sample_key[1]), (-0.05 if sequence.sample_key[1] == 2 else -0.5)
    scheduler.add(request)
    outputs, sequences = run_to_end(scheduler, model)
    assert max(sequences) == 3, "siblings count against max_num_seqs"
    final = outputs[-1]
    assert final.new_token_ids == [1002, 1002, 1002, EOT] and final.summary.num_attempts == 4
    assert len({request.sample_seed} | {request.group.seed((0, i)) for i in range(4)}) == 4
    assert_nothing_held(scheduler)


def test_siblings_share_whole_prompt_blocks_and_compute_the_rest():
    scheduler = make_scheduler(num_blocks=1000, block_size=4)
    prompt = list(range(20000, 20010))  # 10 tokens: blocks 0-1 shareable, the third not
    # Greedy fails; 0.5's two samples go to the request itself and one sibling.
    request = make_request("a", params=SamplingParams(fallback_temperatures=(0.5,), best_of=2), prompt=prompt)
    scheduler.add(request)
    run = fails_until(passing=0.5, length_by_temperature={0.0: 3, 0.5: 3})
    for _ in range(3):
        step_model(scheduler, run)
    output = scheduler.schedule()
    (sibling,) = [r for r in output.scheduled if r.is_sibling]
    assert sibling.self_block_table[:2] == request.self_block_table[:2]
    assert sibling.self_block_table[2] != request.self_block_table[2]
    assert sibling.num_new_tokens == 10 - 8, "it computes the prompt tokens past the shared blocks"
    assert request.num_new_tokens == 1, "the request recomputes its last prompt token"
    scheduler.update(output, SamplerOutput([1000, 1000], [-0.1, -0.1]))
    run_to_end(scheduler, run)
    assert_nothing_held(scheduler)


def test_abort_drops_the_siblings():
    scheduler = make_scheduler()
    scheduler.add(make_request("a", params=SamplingParams(fallback_temperatures=FALLBACK, best_of=3)))
    model = fails_until(passing=9.0, length_by_temperature={0.0: 2})
    for _ in range(4):
        step_model(scheduler, model)
    assert len(scheduler.running) == 8
    scheduler.abort("a")
    assert_nothing_held(scheduler)
    assert not scheduler.has_unfinished_requests()


def test_groups_under_block_pressure_finish_without_leaks_or_deadlock():
    rng = random.Random(11)
    scheduler = make_scheduler(num_blocks=3 * 375 + 40, block_size=4, max_num_seqs=24, max_encoder_batch=8)
    lengths = {}
    for i in range(30):
        params = SamplingParams(fallback_temperatures=FALLBACK, best_of=rng.choice([1, 2, 5]))
        request = make_request(f"r{i}", params=params)
        scheduler.add(request)
    passing = {f"r{i}": rng.choice([0.0, 0.4, 1.0, 9.0]) for i in range(30)}

    def model(sequence):
        request = sequence.primary or sequence
        key = (request.request_id, sequence.sample_key)
        length = lengths.setdefault(key, rng.randint(1, 150))
        done = len(sequence.output_token_ids) + 1 >= length
        return (EOT if done else 1000), (-0.1 if sequence.temperature >= passing[request.request_id] else -3.0)
    finished = []
    for _ in range(20_000):
        if not scheduler.has_unfinished_requests():
            break
        output, outputs = step_model(scheduler, model)
        finished += [o.request_id for o in outputs if o.finished]
        assert len(scheduler.running) <= 24
        if rng.random() < 0.01 and scheduler.requests:
            victim = rng.choice(sorted(scheduler.requests))
            scheduler.abort(victim)
            finished.append(victim)
    assert not scheduler.has_unfinished_requests(), "every request finishes"
    assert scheduler.num_preemptions > 0
    assert sorted(finished) == sorted(f"r{i}" for i in range(30))
    assert_nothing_held(scheduler)


def test_a_looping_sample_ends_early_only_where_a_fallback_follows():
    def looping(sequence):
        return 1000 + len(sequence.output_token_ids) % 3, -0.1  # "t1000 t1001 t1002" over and over

    for fallback, expected_max in ((FALLBACK, 100), ((), 224)):
        scheduler = make_scheduler()
        request = make_request("a", params=SamplingParams(fallback_temperatures=fallback))
        scheduler.add(request)
        first_attempt = []
        for _ in range(300):
            step_model(scheduler, looping)
            if request.sample_key != (0, 0) or not scheduler.has_unfinished_requests():
                break
            first_attempt = list(request.output_token_ids)
        if fallback:
            assert 9 <= len(first_attempt) < expected_max, "the loop was cut once it could no longer pass"
        else:
            assert request.finish_reason == "length" and len(request.output_token_ids) == expected_max


def test_tail_repeats():
    from asrserve.engine.fallback import tail_repeats

    assert tail_repeats([5, 1, 2, 1, 2, 1, 2], TIMESTAMP_BEGIN)
    assert tail_repeats([7, 7, 7], TIMESTAMP_BEGIN)
    assert not tail_repeats([7, 7], TIMESTAMP_BEGIN)
    assert not tail_repeats([1, 2, 3, 1, 2, 3, 1, 2], TIMESTAMP_BEGIN)
    # Rising timestamps between the repeats do not hide the loop.
    ts = TIMESTAMP_BEGIN
    assert tail_repeats([ts, 1, 2, ts + 5, ts + 5, 1, 2, ts + 9, ts + 9, 1, 2, ts + 14], TIMESTAMP_BEGIN)


@pytest.mark.parametrize("fallback", [(), FALLBACK], ids=["decode-once", "with-fallback"])
def test_a_request_that_does_not_stream_tokens_sends_its_first_token_then_everything_at_the_end(fallback):
    """stream_tokens=False (a non-streamed HTTP response): two outputs, not one per token; what
    the request gathers from them is what a streamed one gathers."""
    from asrserve.entrypoints.pieces import PieceResult

    gathered = {}
    for stream_tokens in (True, False):
        scheduler = make_scheduler()
        params = SamplingParams(fallback_temperatures=fallback, stream_tokens=stream_tokens)
        scheduler.add(make_request("a", params=params))
        outputs, _ = run_to_end(scheduler, fails_until(passing=0.0, length_by_temperature={0.0: 30}))
        piece = PieceResult(0.0, 30.0)
        for output in outputs:
            piece.add(output)
        gathered[stream_tokens] = (piece.token_ids, piece.logprobs, piece.finish_reason)
        assert_nothing_held(scheduler)
        if not stream_tokens:
            first, final = outputs
            assert first.new_token_ids == [1000] and not first.finished
            assert final.finished and final.restarted and final.new_token_ids == piece.token_ids
        elif not fallback:
            assert len(outputs) == 30, "one output per token"
    assert gathered[True] == gathered[False]


def test_without_streamed_tokens_the_first_text_token_still_comes_before_the_finish():
    """A timestamped decode begins with a timestamp: the outputs go on to the first text token,
    which is when the server stamps the time to first token."""
    scheduler = make_scheduler()
    scheduler.add(make_request("a", params=SamplingParams(timestamps=True, stream_tokens=False)))
    tokens = [TIMESTAMP_BEGIN, 1000, 1001, 1002, TIMESTAMP_BEGIN + 50, EOT]
    outputs, _ = run_to_end(scheduler, lambda r: (tokens[len(r.output_token_ids)], -0.1))
    assert [o.new_token_ids for o in outputs[:-1]] == [[TIMESTAMP_BEGIN], [1000]]
    assert outputs[-1].finished and outputs[-1].new_token_ids == tokens


def test_a_sequence_let_go_for_an_older_ones_sibling_leaves_the_step():
    """Running sequences are scheduled oldest first; a sibling of an older request (they sit at
    the end of the running list) may need a block only once a newer request is already in the
    step, and that request is then preempted: it must not stay in the step (its blocks and
    cross slot are gone)."""
    from dataclasses import replace

    always_fails = replace(SamplingParams.transcription(0.0), logprob_threshold=0.0)
    runs_with_a_preemption = 0
    for seed in range(12):
        rng = random.Random(seed)
        scheduler = make_scheduler(num_blocks=2 * 94 + 7, max_num_seqs=8)
        scheduler.add(make_request("a", params=always_fails, max_tokens=60))
        scheduler.add(make_request("b", max_tokens=200, prompt=[1] * rng.randrange(1, 30)))
        for _ in range(400):
            output = scheduler.schedule()
            assert all(r.status is RequestStatus.RUNNING and r.cross_slot is not None for r in output.scheduled)
            runs_with_a_preemption += bool(output.preempted)
            tokens = [EOT if r.request_id.startswith("a") and rng.random() < 0.08 else rng.randrange(0, 40000)
                      for r in output.scheduled]
            scheduler.update(output, SamplerOutput(tokens, [-0.1] * len(tokens)))
            if not scheduler.has_unfinished_requests():
                break
        assert not scheduler.has_unfinished_requests()
        assert_nothing_held(scheduler)
    assert runs_with_a_preemption


def test_the_text_token_limit_counts_each_token_once_and_each_sample_afresh():
    """max_text_tokens (a limit asked for, with timestamps) counts text tokens only, below
    <|endoftext|>, and stops at the timestamp closing the segment the limit falls in; a
    sibling's restart on another sample gives a new outputs list, counted anew."""
    eot = 50
    request = make_request("r", max_tokens=100)
    request.max_text_tokens = 3
    for token, at_limit in ((60, False), (7, False), (61, False), (8, False), (9, False), (10, False), (62, True)):
        request.output_token_ids.append(token)
        assert request.at_length_limit(10_000, eot) is at_limit
    request.output_token_ids = [60, 7, 61]  # another sample: one text token so far, a segment closed
    assert not request.at_length_limit(10_000, eot)
    request.output_token_ids += [8, 9]
    assert not request.at_length_limit(10_000, eot)
    request.output_token_ids += [63]
    assert request.at_length_limit(10_000, eot)


@pytest.mark.parametrize("num_blocks", [122, 123, 130, 135, 149])
@pytest.mark.parametrize("own_sample_ends_at", [None, 60])
def test_samples_that_need_the_whole_context_finish_in_the_smallest_pool(num_blocks, own_sample_ends_at):
    """best_of 2, a sample to the end of the context after a long prompt, in a pool that holds
    one full-length request (122 blocks) and little more: the request's own sample finished
    first and parked holding its blocks; its sibling then ran out of room, let itself go,
    restarted from the same seed and ran out again, for ever (the engine stepped without end,
    nothing else admitted). Parked, a request keeps only the blocks its siblings read."""
    scheduler = make_scheduler(num_blocks=num_blocks, max_num_seqs=3, max_encoder_batch=1)
    prompt = [50360] + [1000] * 223 + [SOT, NO_TIMESTAMPS]
    params = SamplingParams(temperature=1.0, best_of=2, ignore_eos=True)
    request = make_request("a", max_tokens=448 - len(prompt), params=params, prompt=prompt)
    scheduler.add(request)
    later = make_request("b")
    scheduler.add(later)

    def model(sequence):
        if sequence.sample_key == (0, 0) and len(sequence.output_token_ids) == own_sample_ends_at:
            return EOT, -0.5  # (ignore_eos still ends a sample where the model is made to)
        return 2000 + len(sequence.output_token_ids), -0.5

    outputs, _ = run_to_end(scheduler, model, max_steps=3000)
    finished = {output.request_id: output for output in outputs if output.finished}
    assert len(request.group.finished) == 2
    assert "b" in finished  # and the request behind it is served
    assert_nothing_held(scheduler)


def _scheduler_on_a_fake_clock(max_num_seqs: int, num_blocks: int) -> tuple[Scheduler, list[float]]:
    """One audio per encoder forward and encoder_time_share 0.5; the clock reads now[0]."""
    now = [0.0]
    blocks = BlockManager(num_blocks, 16, cross_len=1500)
    config = SchedulerConfig(max_num_seqs=max_num_seqs, max_encoder_batch=1, encoder_time_share=0.5)
    scheduler = Scheduler(config, blocks, EncoderCacheManager(1), FakeTokenizer(), max_model_len=448)
    scheduler.waiting.clock = lambda: now[0]
    return scheduler, now


def test_beside_streamed_decodes_later_pieces_wait_for_the_encoder_s_share_of_time():
    """encoder_time_share 0.5: beside streamed decodes, after a step that ran the encoder for T, a
    later piece of a stream waits until decode-only steps have run T (a backlog of pieces held
    every running decode, and so each stream's first text, to a token per encoder forward); a
    first piece (a short file, or a long one's opening) goes ahead of it, as do live requests;
    beside decodes whose text is sent whole, and with nothing decoding, nothing waits."""
    scheduler, now = _scheduler_on_a_fake_clock(max_num_seqs=8, num_blocks=800)
    later = SamplingParams(follows_earlier_text=True)

    def timed_step() -> list[str]:
        output = scheduler.schedule()
        now[0] += 0.4 if output.encoder_requests else 0.01  # an encoder forward, or a decode step
        scheduler.update(output, SamplerOutput([1000] * len(output.scheduled), [-0.1] * len(output.scheduled)))
        return [r.request_id for r in output.encoder_requests]

    scheduler.add(make_request("a"))
    for name in ("a2", "a3"):
        scheduler.add(make_request(name, params=later))
    admitted: dict[str, float] = {}
    while len(admitted) < 3:
        started = now[0]
        admitted |= dict.fromkeys(timed_step(), started)
    # a's step ended at 0.4: decode-only steps until 0.8; a2's ended at ~1.2: until ~1.6.
    assert admitted["a"] == 0 and 0.8 - 1e-9 <= admitted["a2"] < 0.82
    assert 1.6 - 1e-9 <= admitted["a3"] < 1.64
    # Inside a3's decode-only time: a4 waits; the first pieces queued behind it go first.
    scheduler.add(make_request("a4", params=later))
    scheduler.add(make_request("b"))
    scheduler.add(Request("live", np.zeros(16000, np.float32), [SOT, NO_TIMESTAMPS], SamplingParams(), 224,
                          interactive=True))
    assert timed_step() == ["live"] and timed_step() == ["b"]
    assert [r.request_id for r in scheduler.waiting] == ["a4"]
    for name in ("a", "a2", "a3", "live", "b"):
        scheduler.abort(name)
    assert timed_step() == ["a4"]  # nothing decodes: at once, inside b's decode-only time
    scheduler.abort("a4")
    whole = [SamplingParams(stream_tokens=False), SamplingParams(stream_tokens=False, follows_earlier_text=True)]
    for name, params in zip(("c", "c2", "c3"), (whole[0], whole[1], whole[1])):
        scheduler.add(make_request(name, params=params))
    assert [timed_step() for _ in range(3)] == [["c"], ["c2"], ["c3"]]  # text sent whole: back to back


def test_first_pieces_going_ahead_hold_a_later_piece_at_most_max_later_piece_hold_s():
    """Every admission ahead of a held later piece starts another hold: with a short file
    arriving every step beside a stream, the upload's next piece (and the text a client is
    reading mid-way) waited for as long as the flow lasted. It goes in once held for
    MAX_LATER_PIECE_HOLD_S, and waits its own hold after that."""
    from asrserve.engine.waiting_queue import MAX_LATER_PIECE_HOLD_S

    scheduler, now = _scheduler_on_a_fake_clock(max_num_seqs=64, num_blocks=3000)
    later = SamplingParams(follows_earlier_text=True)
    scheduler.add(make_request("a"))
    scheduler.add(make_request("a2", params=later))
    scheduler.add(make_request("a3", params=later))
    admitted: dict[str, float] = {}
    for i in range(12):
        scheduler.add(make_request(f"short-{i}"))  # a first piece waiting at every step
        output = scheduler.schedule()
        admitted |= dict.fromkeys((r.request_id for r in output.encoder_requests), now[0])
        now[0] += 0.4 if output.encoder_requests else 0.01
        scheduler.update(output, SamplerOutput([1000] * len(output.scheduled), [-0.1] * len(output.scheduled)))
    # a's forward ended at 0.4; a2 was first held at 0.4 (short-0 went ahead), so in at 1.6, the
    # first step at least MAX_LATER_PIECE_HOLD_S later; a3, the head from then, waits its own hold.
    assert admitted["a"] == 0 and admitted["short-0"] == pytest.approx(0.4)
    assert MAX_LATER_PIECE_HOLD_S <= admitted["a2"] - 0.4 < MAX_LATER_PIECE_HOLD_S + 0.41
    assert MAX_LATER_PIECE_HOLD_S <= admitted["a3"] - admitted["a2"] < MAX_LATER_PIECE_HOLD_S + 0.41
    assert sum(name.startswith("short") for name in admitted) == 12 - 3  # a step each went to a, a2 and a3
