"""Sizing the KV pool on a GPU from a profile of the worst step.

The pool takes what the share of the GPU we may use (--gpu-memory-utilization) leaves after the
weights, other processes, and the largest transient memory one step can need: a full encoder
batch, or a decode step of max_num_seqs requests at full context with word timestamps and
a no-speech row each (gather buffers, fp32 logits, sampler temporaries, alignment scores). The
pool never grows past what max_num_seqs full-length requests can use: a larger one would only
starve a second engine in the same process (a test suite's fixtures, a repeated ASR())."""

from __future__ import annotations

import logging
import math

import numpy as np
import torch

from asrserve.config import N_FRAMES, SAMPLE_RATE, EngineConfig
from asrserve.engine.request import Request, SamplingParams

logger = logging.getLogger(__name__)

_GIB = 1 << 30


def blocks_per_request(runner) -> int:
    return runner.num_cross_blocks + math.ceil(runner.dims.n_text_ctx / runner.block_size)


def gpu_kv_blocks(runner, config: EngineConfig) -> int:
    """Blocks for the pool: what max_num_seqs requests can use, at most what the budget leaves."""
    wanted = config.scheduler.max_num_seqs * blocks_per_request(runner)
    device = runner.device
    torch.cuda.synchronize(device)
    torch.cuda.empty_cache()
    free, total = torch.cuda.mem_get_info(device)
    used_by_others = total - free - torch.cuda.memory_reserved(device)
    weights = torch.cuda.memory_allocated(device)
    transient = worst_step_bytes(runner, config, wanted)
    budget = int(total * config.cache.gpu_memory_utilization) - used_by_others - weights - transient
    blocks = min(wanted, max(0, budget // runner.kv_block_bytes))
    logger.info(
        "GPU memory: %.1f GiB total, %.1f held by others, weights %.2f, worst step %.2f; KV pool %.2f GiB "
        "(%d blocks, %d wanted by --max-num-seqs %d)",
        total / _GIB, used_by_others / _GIB, weights / _GIB, transient / _GIB,
        blocks * runner.kv_block_bytes / _GIB, blocks, wanted, config.scheduler.max_num_seqs,
    )
    return blocks


@torch.inference_mode()
def worst_step_bytes(runner, config: EngineConfig, wanted_blocks: int) -> int:
    """Peak memory above the weights and the pool of a full encoder batch and of a full decode
    step, measured by running both on a temporary pool of wanted_blocks."""
    device = runner.device
    runner.kv_cache = torch.zeros(runner.kv_cache_shape(wanted_blocks), dtype=runner.dtype, device=device)
    try:
        at_rest = torch.cuda.memory_allocated(device)
        torch.cuda.reset_peak_memory_stats(device)
        batch = config.scheduler.max_encoder_batch
        silence = [np.zeros(N_FRAMES * SAMPLE_RATE // 100, dtype=np.float32)] * batch
        encoded = runner.encode(runner.log_mel(silence).to(runner.dtype))
        slots = list(range(min(batch, config.scheduler.max_num_seqs)))
        runner.model.decoder.write_cross_kv(
            encoded[: len(slots)], runner.kv_cache, slots, runner.decoder_inputs.cross_slot_tokens
        )
        del encoded
        encoder_peak = torch.cuda.max_memory_allocated(device) - at_rest

        torch.cuda.reset_peak_memory_stats(device)
        requests = _full_context_requests(runner, config.scheduler.max_num_seqs)
        # The gather path, not the decode kernels: a step with any prompt rows runs its
        # self-attention through gathered K/V buffers, the larger transient.
        inputs = runner.decoder_inputs.build(requests, decode_kernels=False)
        hidden = runner.model.decoder(inputs.input_ids, inputs.positions, runner.kv_cache, inputs.metadata)
        logits = runner.model.decoder.compute_logits(hidden[inputs.logits_indices])
        del hidden
        runner.sampler(logits[: len(requests)], requests)
        scores = runner._alignment_scores(inputs, requests)
        torch.cuda.synchronize(device)
        decode_peak = torch.cuda.max_memory_allocated(device) - at_rest
        del logits, scores, inputs
    finally:
        runner.kv_cache = None
        torch.cuda.empty_cache()
    # Decode graphs keep their own memory pool for good: at most a decode step's temporaries.
    graphs = decode_peak if runner.uses_decode_graphs else 0
    return max(encoder_peak, decode_peak) + graphs


def _full_context_requests(runner, num_seqs: int) -> list[Request]:
    """num_seqs requests one token short of the full decoder context, each with its own blocks
    of the temporary pool, sampling with timestamps and word timestamps."""
    dims, per_request = runner.dims, blocks_per_request(runner)
    self_blocks = per_request - runner.num_cross_blocks
    params = SamplingParams(temperature=0.0, timestamps=True, word_timestamps=True)
    audio = np.zeros(SAMPLE_RATE, dtype=np.float32)
    requests = []
    for index in range(num_seqs):
        request = Request(f"profile-{index}", audio, [0] * 4, params, dims.n_text_ctx)
        request.output_token_ids = [0] * (dims.n_text_ctx - 4)
        request.num_computed_tokens = request.num_tokens - 1
        first_block = num_seqs * runner.num_cross_blocks + index * self_blocks
        request.self_block_table = list(range(first_block, first_block + self_blocks))
        request.cross_slot = index
        requests.append(request)
    return requests
