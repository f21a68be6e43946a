"""Decode attention on CUDA that reads the KV pool in place: one Triton program per (request,
head) walks that request's keys and values where they live, with an online softmax.

A pure decode step (one new token per request) attends over two kinds of keys:
- self-attention: the request's own tokens, token-major in the blocks its block table names
  (slot = block * block_size + offset, [heads, head_dim] per slot);
- cross-attention: its 1500 encoder positions, head-major in its cross slot
  ([heads, slot_tokens, head_dim], see attention.py).

The torch path gathers the self-attention blocks into a padded copy, and runs cross-attention
as SDPA over views of neighbouring slots, one call per run of them: shapes and call counts that
change every step, which a CUDA graph cannot hold. Here every step is two kernel launches per
layer whose grid is the batch, with the block tables, lengths and slots read from device
memory: the shape of a graph (cuda_graphs.py). The gather path stays the reference these
kernels are tested against (in CI through Triton's interpreter, TRITON_INTERPRET=1).

Each program accumulates in float32 and visits keys in tiles of BLOCK_T; its result does not
depend on which other requests share the step.
"""

from __future__ import annotations

import functools

import torch


@functools.cache
def available() -> bool:
    """Triton can be imported (CUDA builds of torch bring it; CPU CI installs it for tests)."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


@functools.cache
def _kernel():
    import triton
    import triton.language as tl

    @triton.jit
    def decode_attention_kernel(
        q_ptr, k_ptr, v_ptr, out_ptr, lengths_ptr, tables_ptr, slots_ptr,
        q_stride_row, q_stride_head, table_stride, slot_tokens, cross_len, scale,
        NUM_HEADS: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_T: tl.constexpr,
        BLOCK_SIZE: tl.constexpr, CROSS: tl.constexpr,
    ):
        row = tl.program_id(0)
        head = tl.program_id(1)
        dims = tl.arange(0, BLOCK_D)
        dim_ok = dims < HEAD_DIM
        q = tl.load(q_ptr + row * q_stride_row + head * q_stride_head + dims, mask=dim_ok, other=0.0)
        q = q.to(tl.float32) * scale
        if CROSS:
            length = cross_len
            slot = tl.load(slots_ptr + row).to(tl.int64)
            base = slot * slot_tokens * (NUM_HEADS * HEAD_DIM) + head * slot_tokens * HEAD_DIM
        else:
            length = tl.load(lengths_ptr + row).to(tl.int32)
            base = head * HEAD_DIM
        running_max = tl.full([], float("-inf"), tl.float32)
        denominator = tl.full([], 0.0, tl.float32)
        acc = tl.zeros([BLOCK_D], dtype=tl.float32)
        for start in range(0, length, BLOCK_T):
            positions = start + tl.arange(0, BLOCK_T)
            in_range = positions < length
            if CROSS:
                offsets = base + positions[:, None].to(tl.int64) * HEAD_DIM + dims[None, :]
            else:
                blocks = tl.load(tables_ptr + row * table_stride + positions // BLOCK_SIZE, mask=in_range, other=0)
                token_slots = blocks.to(tl.int64) * BLOCK_SIZE + positions % BLOCK_SIZE
                offsets = base + token_slots[:, None] * (NUM_HEADS * HEAD_DIM) + dims[None, :]
            load_mask = in_range[:, None] & dim_ok[None, :]
            keys = tl.load(k_ptr + offsets, mask=load_mask, other=0.0).to(tl.float32)
            scores = tl.sum(keys * q[None, :], axis=1)
            scores = tl.where(in_range, scores, float("-inf"))
            new_max = tl.maximum(running_max, tl.max(scores, axis=0))
            weights = tl.exp(scores - new_max)
            rescale = tl.exp(running_max - new_max)
            values = tl.load(v_ptr + offsets, mask=load_mask, other=0.0).to(tl.float32)
            acc = acc * rescale + tl.sum(weights[:, None] * values, axis=0)
            denominator = denominator * rescale + tl.sum(weights, axis=0)
            running_max = new_max
        out = acc / denominator
        tl.store(out_ptr + (row * NUM_HEADS + head) * HEAD_DIM + dims, out.to(out_ptr.dtype.element_ty), mask=dim_ok)

    return decode_attention_kernel


def _launch(query: torch.Tensor, layer_cache: torch.Tensor, *, lengths=None, tables=None, slots=None,
            slot_tokens: int = 0, cross_len: int = 0, cross: bool) -> torch.Tensor:
    import triton

    num_rows, num_heads, head_dim = query.shape
    assert query.stride(2) == 1, "head_dim must be contiguous"
    out = torch.empty(num_rows, num_heads * head_dim, dtype=query.dtype, device=query.device)
    if num_rows == 0:
        return out
    # The other mode's pointers are never read: any integer tensor stands in for them.
    stand_in = slots if cross else lengths
    _kernel()[(num_rows, num_heads)](
        query, layer_cache[0], layer_cache[1], out,
        stand_in if cross else lengths, stand_in if cross else tables, slots if cross else stand_in,
        query.stride(0), query.stride(1), 0 if cross else tables.stride(0), slot_tokens, cross_len,
        head_dim**-0.5,
        NUM_HEADS=num_heads, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
        BLOCK_T=64, BLOCK_SIZE=1 if cross else layer_cache.shape[2], CROSS=cross, num_warps=4,
    )
    return out


def self_attention(query: torch.Tensor, layer_cache: torch.Tensor, block_tables: torch.Tensor,
                   context_lens: torch.Tensor) -> torch.Tensor:
    """query [rows, heads, head_dim], one row per request, over the first context_lens[row]
    tokens of its blocks (block_tables [rows, blocks]) -> [rows, heads * head_dim].
    layer_cache: one layer's pool [2, num_blocks, block_size, heads, head_dim]."""
    return _launch(query, layer_cache, lengths=context_lens, tables=block_tables, cross=False)


def cross_attention(query: torch.Tensor, layer_cache: torch.Tensor, cross_slots: torch.Tensor,
                    slot_tokens: int, cross_len: int) -> torch.Tensor:
    """query [rows, heads, head_dim] over the cross_len encoder positions of each row's cross
    slot (cross_slots [rows]) -> [rows, heads * head_dim]."""
    return _launch(query, layer_cache, slots=cross_slots, slot_tokens=slot_tokens, cross_len=cross_len, cross=True)
