"""Paged attention over the shared KV block pool: the torch gather path.

The pool is one tensor [num_layers, 2 (K, V), num_blocks, block_size, heads, head_dim]. A
request's tokens live in the blocks its block table names; slot = block * block_size + offset.
Self-attention blocks grow with the decoded text; cross-attention blocks hold the K/V of the
request's 1500 encoder positions, written once. This path gathers each request's blocks into a
padded batch and runs one SDPA call for the whole step: it is the CPU path and the reference
for faster kernels. With 16-bit pools on CPU it runs the attention as two matmuls over
head-major copies instead of SDPA (see _attention_head_major).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F


class GatherBuffers:
    """Output memory for gathered K/V, reused step after step. A fresh tensor of ~100 MB per
    layer and step would be fresh pages for the OS to fault in and zero each time, which on
    CPU costs more than the gather itself."""

    def __init__(self):
        self._buffers: dict[str, torch.Tensor] = {}

    def get(self, name: str, shape: tuple[int, ...], like: torch.Tensor) -> torch.Tensor:
        numel = math.prod(shape)
        buffer = self._buffers.get(name)
        if buffer is None or buffer.numel() < numel or buffer.dtype != like.dtype or buffer.device != like.device:
            buffer = torch.empty(numel, dtype=like.dtype, device=like.device)
            self._buffers[name] = buffer
        return buffer[:numel].view(shape)


@dataclass
class AlignmentQuery:
    """Word timestamps: the cross-attention scores of the alignment heads for the last token
    of some requests, filled in by the layers that have such heads."""

    token_rows: torch.Tensor  # [num_aligned] flat-batch row of each aligned request's last token
    cross_block_tables: torch.Tensor  # [num_aligned, cross_blocks]
    heads_by_layer: dict[int, torch.Tensor]  # layer index -> head indices
    scores: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [num_aligned, heads, 1500]


def alignment_scores(
    query: torch.Tensor, layer_cache: torch.Tensor, alignment: AlignmentQuery, heads: torch.Tensor, cross_len: int
) -> torch.Tensor:
    """Pre-softmax q.k / sqrt(head_dim) of the given heads over each aligned request's encoder
    positions: [num_aligned, heads, cross_len]."""
    queries = query.index_select(0, alignment.token_rows).index_select(1, heads)  # [A, h, d]
    num_aligned = queries.shape[0]
    keys = layer_cache[0].index_select(0, alignment.cross_block_tables.flatten())  # [A * nb, bs, H, d]
    keys = keys.view(num_aligned, -1, *keys.shape[-2:])[:, :cross_len].index_select(2, heads)  # [A, K, h, d]
    return torch.einsum("ahd,akhd->ahk", queries.float(), keys.float()) / math.sqrt(queries.shape[-1])


@dataclass
class AttentionMetadata:
    """Where one decoder step's tokens read and write the KV pool; shared by all layers."""

    num_seqs: int
    num_tokens: int  # real tokens; the hidden states may carry padding rows after them
    max_query_len: int
    slot_mapping: torch.Tensor  # [num_tokens] self-attention slot each new token writes
    self_block_tables: torch.Tensor  # [num_seqs, max_self_blocks]
    # [num_seqs, 1, max_query_len, max_self_blocks * block_size], True = may attend
    self_attn_mask: torch.Tensor
    cross_block_tables: torch.Tensor  # [num_seqs, cross_blocks]
    cross_len: int  # encoder positions (1500)
    # token i of the flat batch sits at row padded_index[i] of [num_seqs * max_query_len];
    # None when every request has exactly one new token (pure decode)
    padded_index: torch.Tensor | None
    gather_buffers: GatherBuffers
    alignment: AlignmentQuery | None = None


def write_kv(
    layer_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot_mapping: torch.Tensor
) -> None:
    """Stores [num, heads, head_dim] keys and values at their slots of one layer's pool."""
    num_heads, head_dim = key.shape[-2:]
    layer_cache[0].view(-1, num_heads, head_dim).index_copy_(0, slot_mapping, key)
    layer_cache[1].view(-1, num_heads, head_dim).index_copy_(0, slot_mapping, value)


def paged_attention(
    query: torch.Tensor,
    layer_cache: torch.Tensor,
    block_tables: torch.Tensor,
    metadata: AttentionMetadata,
    attn_mask: torch.Tensor | None = None,
    key_len: int | None = None,
) -> torch.Tensor:
    """query [num_tokens, heads, head_dim] -> [num_tokens, heads * head_dim].

    Keys are the blocks of each request's table, in order; key_len trims the gathered keys
    (cross-attention's 1500 of ceil(1500 / block_size) * block_size) and attn_mask hides the
    rest (self-attention's causal, per-request length).
    """
    num_seqs, max_query_len = metadata.num_seqs, metadata.max_query_len
    num_heads, head_dim = query.shape[-2:]
    block_ids = block_tables.flatten()
    gathered_shape = (block_ids.numel(), *layer_cache.shape[2:])
    buffers = metadata.gather_buffers
    # [num_seqs, blocks * block_size, heads, head_dim]
    keys = torch.index_select(layer_cache[0], 0, block_ids, out=buffers.get("k", gathered_shape, layer_cache))
    values = torch.index_select(layer_cache[1], 0, block_ids, out=buffers.get("v", gathered_shape, layer_cache))
    keys, values = keys.view(num_seqs, -1, num_heads, head_dim), values.view(num_seqs, -1, num_heads, head_dim)
    if key_len is not None:
        keys, values = keys[:, :key_len], values[:, :key_len]

    if metadata.padded_index is None:
        queries = query.view(num_seqs, 1, num_heads, head_dim)
    else:
        queries = query.new_zeros(num_seqs * max_query_len, num_heads, head_dim)
        queries.index_copy_(0, metadata.padded_index, query)
        queries = queries.view(num_seqs, max_query_len, num_heads, head_dim)

    if query.device.type == "cpu" and query.dtype != torch.float32:
        out = _attention_head_major(queries, keys, values, attn_mask, buffers)
    else:
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=attn_mask
        )
    out = out.transpose(1, 2).reshape(num_seqs * max_query_len, num_heads * head_dim)
    if metadata.padded_index is not None:
        out = out.index_select(0, metadata.padded_index)
    return out


def _attention_head_major(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attn_mask: torch.Tensor | None,
    buffers: GatherBuffers,
) -> torch.Tensor:
    """[N, Q, H, D] queries over [N, K, H, D] keys -> [N, H, Q, D]: the CPU path for 16-bit pools.

    torch's CPU SDPA kernel reads 16-bit K/V in [N, K, H, D] order slowly: on 2 AVX512-BF16 cores
    a decode step's cross-attention over 32 requests takes 22 ms per layer in bf16 against 8.5
    in fp32. Copying K/V head-major ([N, H, K, D], into reused buffers) and running two batched
    bf16 matmuls takes ~7 ms. The scores are rounded to bf16 before the softmax."""
    num_seqs, key_len, num_heads, head_dim = keys.shape
    shape = (num_seqs, num_heads, key_len, head_dim)
    keys = buffers.get("k_heads", shape, keys).copy_(keys.transpose(1, 2))
    values = buffers.get("v_heads", shape, values).copy_(values.transpose(1, 2))
    scores = torch.matmul(queries.transpose(1, 2) * head_dim**-0.5, keys.transpose(-1, -2))  # [N, H, Q, K]
    if attn_mask is not None:
        scores.masked_fill_(~attn_mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), values)


def build_self_attn_mask(
    context_lens: torch.Tensor, query_lens: torch.Tensor, max_query_len: int, num_key_slots: int
) -> torch.Tensor:
    """Causal mask within each request's context: query i of a request whose context (after
    this step's tokens) is L and which adds q tokens sits at position L - q + i and sees keys
    0 ... L - q + i. Padding query rows see key 0 only, so no row is all-masked."""
    query_offsets = torch.arange(max_query_len, device=context_lens.device)
    query_positions = (context_lens - query_lens)[:, None] + query_offsets[None, :]
    query_positions = torch.where(query_offsets[None, :] < query_lens[:, None], query_positions, 0)
    key_positions = torch.arange(num_key_slots, device=context_lens.device)
    mask = key_positions[None, None, :] <= query_positions[:, :, None]
    return mask[:, None]  # broadcast over heads
