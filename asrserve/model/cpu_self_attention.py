"""Self-attention of a decode step on CPU in bfloat16, as a small C kernel (csrc/).

A decode step's self-attention is tiny work (one query row per sequence over its few dozen
decoded tokens), but the torch path (attention.paged_attention) spends it in a dozen ops per
layer: two gathers of every sequence's blocks into a padded batch, a head-major copy of each,
the causal mask, two batched matmuls and a softmax, and a copy back to flat rows. At one
request that is ~12% of a tiny.en step (~0.18 ms a layer on 2 cores), nearly all of it the
ops' fixed costs. The kernel reads each token's keys and values where they live in the pool,
through its sequence's block table, and keeps scores, softmax and sums in float32, rounding the
output to bf16 once (the torch path rounds the scores to bf16 first).

Each (token, head) is computed on its own, so a token's output does not depend on the other
sequences in the step, nor on other tokens of its own (batch invariance).

Built and loaded by cpu_kernels.py; where it cannot run (no AVX512-BF16, no C compiler,
ASRSERVE_CPU_KERNELS=0) the torch path serves.
"""

from __future__ import annotations

import ctypes

import torch

from asrserve.model import cpu_kernels


def _kernel():
    return cpu_kernels.load("self_attention_bf16.c", "asrserve_self_attention_bf16",
                            (ctypes.c_void_p,) * 7 + (ctypes.c_int64,) * 7 + (ctypes.c_int,))


def available() -> bool:
    return _kernel() is not None


def self_attention(query: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor,
                   token_seqs: torch.Tensor, token_keys: torch.Tensor) -> torch.Tensor:
    """query [num_tokens, heads, head_dim] over one layer's pool layer_cache [2, num_blocks,
    block_size, heads, head_dim], all bf16 on CPU -> [num_tokens, heads * head_dim]. Token t
    attends over the first token_keys[t] keys of sequence token_seqs[t], whose blocks are
    block_tables[token_seqs[t]] (int64, [num_seqs, max_blocks])."""
    kernel = _kernel()
    assert kernel is not None, "the kernel is not available here (see available())"
    num_tokens, heads, head_dim = query.shape
    _, num_blocks, block_size = layer_cache.shape[:3]
    assert layer_cache.shape[3:] == (heads, head_dim) and layer_cache.is_contiguous()
    assert query.dtype == layer_cache.dtype == torch.bfloat16 and query.device.type == "cpu"
    for index in (block_tables, token_seqs, token_keys):
        assert index.dtype == torch.int64 and index.device.type == "cpu" and index.is_contiguous()
    assert token_seqs.shape == token_keys.shape == (num_tokens,)
    query = query.contiguous()
    out = torch.empty(num_tokens, heads * head_dim, dtype=query.dtype)
    status = kernel(query.data_ptr(), layer_cache[0].data_ptr(), layer_cache[1].data_ptr(), out.data_ptr(),
                    block_tables.data_ptr(), token_seqs.data_ptr(), token_keys.data_ptr(), num_tokens, heads,
                    head_dim, block_size, *block_tables.shape, num_blocks, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"bf16 self-attention kernel refused its inputs (head_dim {head_dim}, "
                           f"block_size {block_size}, a token's sequence, key count or block out of range)")
    return out
