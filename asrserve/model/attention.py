"""Attention over the shared KV block pool.

The pool is one tensor [num_layers, 2 (K, V), num_blocks, block_size, heads, head_dim].
Self-attention blocks grow with the decoded text: a request's tokens live in the blocks its
block table names (slot = block * block_size + offset), token-major. A request's cross-attention
K/V, its 1500 encoder positions written once, lives in its *cross slot*: num_cross_blocks
consecutive blocks (see BlockManager), whose memory holds the K (and the V) of one layer
head-major, [heads, slot_tokens, head_dim]: the layout attention kernels read fastest, on CPU
(torch's SDPA over 32 requests' cross K/V: 11 ms per layer head-major against 18 token-major)
and on GPU alike.

Self-attention gathers each request's blocks into a padded batch and runs one SDPA call
(paged_attention). Cross-attention reads each request's K/V where it lives: requests in
neighbouring slots are one strided view of the pool and attend in one call, with no copy of
their 1500 positions (cross_attention_in_place); in bf16 on CPU a C kernel reads them
(cpu_cross_attention.py). cross_attention_gathered copies every slot into one batch first: the
reference the in-place path is tested against.
"""

from __future__ import annotations

import functools
import math
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from asrserve.model import cpu_cross_attention


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
    cross_slots: list[int]  # [num_aligned] each aligned request's cross slot
    heads_by_layer: dict[int, torch.Tensor]  # layer index -> head indices
    scores: dict[int, torch.Tensor] = field(default_factory=dict)  # layer -> [num_aligned, heads, 1500]


def cross_slot_view(layer_kv: torch.Tensor, first_slot: int, num_slots: int, slot_tokens: int, cross_len: int):
    """The K (or V) of num_slots neighbouring cross slots of one layer, read in place:
    layer_kv [num_blocks, block_size, heads, head_dim] -> [num_slots, heads, cross_len, head_dim]."""
    num_heads, head_dim = layer_kv.shape[-2:]
    region = layer_kv.view(-1, num_heads, head_dim)[first_slot * slot_tokens:(first_slot + num_slots) * slot_tokens]
    return region.view(num_slots, num_heads, slot_tokens, head_dim)[:, :, :cross_len]


def write_cross_kv(layer_cache: torch.Tensor, key: torch.Tensor, value: torch.Tensor, slot: int, slot_tokens: int) -> None:
    """Stores one request's [cross_len, heads, head_dim] encoder keys and values head-major in its
    slot, and zeros the slot's positions past cross_len: the CPU 16-bit path reads the whole slot
    and masks them (cross_attention_in_place), and a zero weight times a stale NaN would still
    be NaN."""
    cross_len = key.shape[0]
    for layer_kv, source in ((layer_cache[0], key), (layer_cache[1], value)):
        whole_slot = cross_slot_view(layer_kv, slot, 1, slot_tokens, slot_tokens)[0]
        whole_slot[:, :cross_len].copy_(source.transpose(0, 1))
        whole_slot[:, cross_len:].zero_()


def alignment_scores(
    query: torch.Tensor, layer_cache: torch.Tensor, alignment: AlignmentQuery, heads: torch.Tensor,
    metadata: AttentionMetadata,
) -> torch.Tensor:
    """Pre-softmax q.k / sqrt(head_dim) of the given heads over each aligned request's encoder
    positions: [num_aligned, heads, cross_len]."""
    queries = query.index_select(0, alignment.token_rows).index_select(1, heads)  # [A, h, d]
    keys = torch.stack([
        cross_slot_view(layer_cache[0], slot, 1, metadata.cross_slot_tokens, metadata.cross_len)[0].index_select(0, heads)
        for slot in alignment.cross_slots
    ])  # [A, h, K, d]
    return torch.einsum("ahd,ahkd->ahk", queries.float(), keys.float()) / math.sqrt(queries.shape[-1])


@dataclass(frozen=True)
class CrossRun:
    """Requests in neighbouring cross slots that each bring the same number of query rows
    (siblings of one request share a slot and bring one row each): one view, one call."""

    first_slot: int
    num_slots: int
    rows_per_slot: int


@dataclass
class AttentionMetadata:
    """Where one decoder step's tokens read and write the KV pool; shared by all layers."""

    num_seqs: int
    num_tokens: int  # real tokens; the hidden states may carry padding rows after them
    max_query_len: int
    slot_mapping: torch.Tensor  # [num_tokens] self-attention slot each new token writes
    self_block_tables: torch.Tensor  # [num_seqs, max_self_blocks]
    # [num_seqs, 1, max_query_len, max_self_blocks * block_size], True = may attend
    self_attn_mask: torch.Tensor | None
    cross_slots: list[int]  # [num_seqs] each sequence's cross slot (siblings share one)
    cross_slot_tokens: int  # positions per slot: num_cross_blocks * block_size
    cross_len: int  # encoder positions (1500)
    # token i of the flat batch sits at row padded_index[i] of [num_seqs * max_query_len];
    # None when every request has exactly one new token (pure decode)
    padded_index: torch.Tensor | None
    gather_buffers: GatherBuffers
    alignment: AlignmentQuery | None = None
    # Cross-attention in place; None: the gathered reference. The flat rows in slot order are
    # query rows cross_row_order (None: already in order), and the output goes back to flat
    # order by cross_row_inverse.
    cross_runs: list[CrossRun] | None = None
    cross_row_order: torch.Tensor | None = None
    cross_row_inverse: torch.Tensor | None = None
    # CUDA pure decode steps (one token per sequence): both attentions through
    # decode_attention's kernels, which read the pool in place by these device tensors;
    # self_attn_mask and the gather buffers are then unused.
    decode_kernels: bool = False
    context_lens: torch.Tensor | None = None  # [num_seqs] tokens each sequence attends over
    cross_slot_ids: torch.Tensor | None = None  # [num_seqs] cross_slots on the device
    # CPU bf16: self-attention through cpu_self_attention's kernel, which reads the pool in place
    # by self_block_tables and these (self_attn_mask is then None): [num_tokens] each token's
    # sequence, and how many of its keys it sees.
    token_seqs: torch.Tensor | None = None
    token_keys: torch.Tensor | None = None
    query_lens: list[int] | None = None  # [num_seqs] each sequence's new tokens (host side)


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
) -> torch.Tensor:
    """query [num_tokens, heads, head_dim] -> [num_tokens, heads * head_dim].

    Keys are the blocks of each request's table, in order; attn_mask hides the rest
    (self-attention's causal, per-request length).
    """
    num_seqs = metadata.num_seqs
    num_heads, head_dim = query.shape[-2:]
    block_ids = block_tables.flatten()
    gathered_shape = (block_ids.numel(), *layer_cache.shape[2:])
    buffers = metadata.gather_buffers
    # [num_seqs, blocks * block_size, heads, head_dim]
    keys = torch.index_select(layer_cache[0], 0, block_ids, out=buffers.get("k", gathered_shape, layer_cache))
    values = torch.index_select(layer_cache[1], 0, block_ids, out=buffers.get("v", gathered_shape, layer_cache))
    keys, values = keys.view(num_seqs, -1, num_heads, head_dim), values.view(num_seqs, -1, num_heads, head_dim)

    queries = _padded_queries(query, metadata)
    if query.device.type == "cpu" and query.dtype != torch.float32:
        out = _attention_head_major(queries, keys, values, attn_mask, buffers)
    elif query.device.type == "cpu":
        out = _self_attention_one_sequence_at_a_time(queries, keys, values, attn_mask, metadata.query_lens)
    else:
        out = F.scaled_dot_product_attention(
            queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2), attn_mask=attn_mask
        )
    return _flat_rows(out, metadata)


def _self_attention_one_sequence_at_a_time(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attn_mask: torch.Tensor, query_lens=None
) -> torch.Tensor:
    """[N, Q, H, D] queries over [N, K, H, D] gathered keys -> [N, H, Q, D], one SDPA call per
    sequence over its own keys and query rows (past query_lens: left zero). The CPU kernel's
    rounding depends on the batch, the key length and the query rows, all set by neighbours
    (_sdpa_one_slot_at_a_time): a decode row padded to a neighbour's prompt length moved a bit.
    A sequence's keys are a prefix, as long as the most any of its query rows may see."""
    num_seqs, max_query_len, num_heads, head_dim = queries.shape
    lengths = attn_mask.any(dim=2).sum(dim=-1).flatten().tolist()  # [N] keys each sequence uses
    out = queries.new_zeros(num_seqs, num_heads, max_query_len, head_dim)
    rows = query_lens or [max_query_len] * num_seqs
    for i, (length, q) in enumerate(zip(lengths, rows)):
        out[i:i + 1, :, :q] = F.scaled_dot_product_attention(
            queries[i:i + 1, :q].transpose(1, 2), keys[i:i + 1, :length].transpose(1, 2),
            values[i:i + 1, :length].transpose(1, 2), attn_mask=attn_mask[i:i + 1, :, :q, :length],
        )
    return out


def _padded_queries(query: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
    """[num_tokens, H, D] flat rows -> [num_seqs, max_query_len, H, D], zero rows as padding."""
    num_seqs, max_query_len = metadata.num_seqs, metadata.max_query_len
    num_heads, head_dim = query.shape[-2:]
    if metadata.padded_index is None:
        return query.view(num_seqs, 1, num_heads, head_dim)
    queries = query.new_zeros(num_seqs * max_query_len, num_heads, head_dim)
    queries.index_copy_(0, metadata.padded_index, query)
    return queries.view(num_seqs, max_query_len, num_heads, head_dim)


def _flat_rows(out: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
    """[num_seqs, H, max_query_len, D] -> [num_tokens, H * D], the padding rows dropped."""
    num_seqs, num_heads, max_query_len, head_dim = out.shape
    out = out.transpose(1, 2).reshape(num_seqs * max_query_len, num_heads * head_dim)
    if metadata.padded_index is not None:
        out = out.index_select(0, metadata.padded_index)
    return out


def cross_attention_gathered(query: torch.Tensor, layer_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
    """The reference for cross_attention_in_place: every sequence's slot copied into one padded
    batch, one SDPA call. query [num_tokens, heads, head_dim] -> [num_tokens, heads * head_dim]."""
    def gathered(layer_kv: torch.Tensor) -> torch.Tensor:
        return torch.cat([
            cross_slot_view(layer_kv, slot, 1, metadata.cross_slot_tokens, metadata.cross_len)
            for slot in metadata.cross_slots
        ])  # [num_seqs, H, cross_len, D]

    queries = _padded_queries(query, metadata).transpose(1, 2)
    out = F.scaled_dot_product_attention(queries, gathered(layer_cache[0]), gathered(layer_cache[1]))
    return _flat_rows(out, metadata)


def cross_attention_in_place(query: torch.Tensor, layer_cache: torch.Tensor, metadata: AttentionMetadata) -> torch.Tensor:
    """query [num_tokens, heads, head_dim] -> [num_tokens, heads * head_dim], attending over
    each row's request's encoder K/V in its slot of the pool, read through views."""
    num_heads, head_dim = query.shape[-2:]
    slot_tokens, cross_len = metadata.cross_slot_tokens, metadata.cross_len
    if metadata.cross_row_order is not None:
        query = query.index_select(0, metadata.cross_row_order)
    # CPU 16-bit: attend over whole slots (cross_len plus the few positions that round the slot
    # up to whole blocks, masked) so that a run of slots is one dense [slots * heads, positions,
    # head_dim] batch: over the [:cross_len] view, whose slots are strided, the CPU's 16-bit
    # matmul copied all of every slot's K and V first, in every layer and step (tiny.en bf16,
    # 8 requests: 4.1 against 0.5 ms a layer on 2 cores).
    whole_slots = query.device.type == "cpu" and query.dtype != torch.float32
    use_kernel = whole_slots and uses_cpu_kernel(query)
    if use_kernel:  # the kernel takes queries scaled, rounded to bf16 as the torch path rounds them
        query = query * head_dim**-0.5
    read_len = slot_tokens if whole_slots else cross_len
    padding_mask = _slot_positions_read(slot_tokens, cross_len) if whole_slots else None
    outputs, row = [], 0
    for run in metadata.cross_runs:
        keys = cross_slot_view(layer_cache[0], run.first_slot, run.num_slots, slot_tokens, read_len)
        values = cross_slot_view(layer_cache[1], run.first_slot, run.num_slots, slot_tokens, read_len)
        num_rows = run.num_slots * run.rows_per_slot
        queries = query[row:row + num_rows].view(run.num_slots, run.rows_per_slot, num_heads, head_dim)
        row += num_rows
        if use_kernel:
            outputs.append(cpu_cross_attention.cross_attention(queries, keys, values, cross_len).view(num_rows, -1))
            continue
        if whole_slots:
            out = _attention_16bit_cpu(queries.transpose(1, 2), keys, values, padding_mask)
        elif query.device.type == "cpu":
            out = _sdpa_one_slot_at_a_time(queries.transpose(1, 2), keys, values)
        else:
            out = F.scaled_dot_product_attention(queries.transpose(1, 2), keys, values)
        outputs.append(out.transpose(1, 2).reshape(num_rows, num_heads * head_dim))
    out = outputs[0] if len(outputs) == 1 else torch.cat(outputs)
    if metadata.cross_row_inverse is not None:
        out = out.index_select(0, metadata.cross_row_inverse)
    return out


def uses_cpu_kernel(query: torch.Tensor) -> bool:
    """Whether bf16 cross-attention on CPU goes through the C kernel (cpu_cross_attention.py)."""
    return query.dtype == torch.bfloat16 and query.device.type == "cpu" and cpu_cross_attention.available()


@functools.lru_cache(maxsize=8)
def _slot_positions_read(slot_tokens: int, cross_len: int) -> torch.Tensor | None:
    """[slot_tokens] True at the encoder positions of a whole (CPU) slot, False at the few that
    round it up to whole blocks; None when there are none. Made once, not per layer and step."""
    if slot_tokens == cross_len:
        return None
    with torch.inference_mode(False):  # an ordinary tensor, usable inside and outside inference mode
        return torch.arange(slot_tokens) < cross_len


def _sdpa_one_slot_at_a_time(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor) -> torch.Tensor:
    """SDPA per slot on CPU. torch's CPU kernel splits its work by the batch size, and with it
    the order of a row's additions: a request's output differed by ~1e-7 between attending
    alone and beside others, enough to flip a sampled token now and then (batch invariance).
    One call per slot costs about what one batched call does (2 cores, 1500 keys: 9.3 against
    9.4 ms for 32 slots)."""
    if queries.shape[0] == 1:
        return F.scaled_dot_product_attention(queries, keys, values)
    return torch.cat([
        F.scaled_dot_product_attention(queries[i:i + 1], keys[i:i + 1], values[i:i + 1]) for i in range(queries.shape[0])
    ])


def _attention_16bit_cpu(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attn_mask: torch.Tensor | None
) -> torch.Tensor:
    """[N, H, Q, D] queries over head-major [N, H, K, D] keys -> [N, H, Q, D] as two batched
    matmuls: the CPU path for 16-bit pools (see _attention_head_major). The scores are rounded
    to bf16 before the softmax."""
    scores = torch.matmul(queries * queries.shape[-1] ** -0.5, keys.transpose(-1, -2))  # [N, H, Q, K]
    if attn_mask is not None:
        scores.masked_fill_(~attn_mask, float("-inf"))
    return torch.matmul(scores.softmax(-1), values)


def _attention_head_major(
    queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, attn_mask: torch.Tensor | None,
    buffers: GatherBuffers,
) -> torch.Tensor:
    """[N, Q, H, D] queries over token-major [N, K, H, D] keys -> [N, H, Q, D]: the CPU path for
    16-bit pools over gathered (self-attention) K/V.

    torch's CPU SDPA kernel reads 16-bit K/V in [N, K, H, D] order slowly: on 2 AVX512-BF16 cores
    a decode step's cross-attention over 32 requests takes 22 ms per layer in bf16 against 8.5
    in fp32. Copying K/V head-major ([N, H, K, D], into reused buffers) and running two batched
    bf16 matmuls takes ~7 ms."""
    num_seqs, key_len, num_heads, head_dim = keys.shape
    shape = (num_seqs, num_heads, key_len, head_dim)
    keys = buffers.get("k_heads", shape, keys).copy_(keys.transpose(1, 2))
    values = buffers.get("v_heads", shape, values).copy_(values.transpose(1, 2))
    return _attention_16bit_cpu(queries.transpose(1, 2), keys, values, attn_mask)


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
