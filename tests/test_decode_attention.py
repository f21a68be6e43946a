"""decode_attention's Triton kernels against the torch paths they replace on CUDA.

On CPU the kernels run through Triton's interpreter (conftest sets TRITON_INTERPRET=1), so CI
checks the same kernel source the GPU compiles; shapes stay small because the interpreter is
slow. tests/test_gpu.py runs them compiled, at large-v3-turbo's shapes."""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

from asrserve.model import decode_attention
from asrserve.model.attention import (
    AttentionMetadata,
    GatherBuffers,
    build_self_attn_mask,
    cross_attention_gathered,
    paged_attention,
)
from asrserve.model.whisper import TextDecoder, WhisperDims
from asrserve.worker.cuda_graphs import bucket_sizes, is_graphable

pytestmark = pytest.mark.skipif(not decode_attention.available(), reason="needs triton")

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOLERANCE = {torch.float32: 2e-5, torch.bfloat16: 2e-2}


def _pool(num_blocks: int, block_size: int, heads: int, head_dim: int, dtype: torch.dtype) -> torch.Tensor:
    """One layer's pool [2, blocks, block_size, heads, head_dim] of random K/V."""
    generator = torch.Generator().manual_seed(0)
    return torch.randn(2, num_blocks, block_size, heads, head_dim, generator=generator).to(DEVICE, dtype)


def _metadata(context_lens: list[int], tables: list[list[int]], cross_slots: list[int], slot_tokens: int,
              cross_len: int, block_size: int) -> AttentionMetadata:
    width = max(map(len, tables))
    table = torch.tensor([t + [0] * (width - len(t)) for t in tables], device=DEVICE)
    lens = torch.tensor(context_lens, device=DEVICE)
    ones = torch.ones_like(lens)
    return AttentionMetadata(
        num_seqs=len(tables), num_tokens=len(tables), max_query_len=1,
        slot_mapping=torch.zeros(len(tables), dtype=torch.long, device=DEVICE), self_block_tables=table,
        self_attn_mask=build_self_attn_mask(lens, ones, 1, width * block_size), cross_slots=cross_slots,
        cross_slot_tokens=slot_tokens, cross_len=cross_len, padded_index=None, gather_buffers=GatherBuffers(),
        context_lens=lens, cross_slot_ids=torch.tensor(cross_slots, device=DEVICE),
    )


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
@pytest.mark.parametrize("head_dim", [16, 24], ids=["pow2", "not-pow2"])
def test_self_attention_reads_the_blocks_in_place_like_the_gather_path(dtype, head_dim):
    heads, block_size = 3, 4
    layer = _pool(40, block_size, heads, head_dim, dtype)
    # Lengths from one token to a tile and more (the kernel walks 64 keys at a time), tables
    # in any order, rows of different widths.
    context_lens = [1, 5, 16, 70, 3]
    rng = np.random.default_rng(1)
    tables = [rng.permutation(40)[: math.ceil(n / block_size)].tolist() for n in context_lens]
    metadata = _metadata(context_lens, tables, [0] * 5, 8, 8, block_size)
    # q as the decoder makes it: a strided view of the fused q/k/v projection
    qkv = torch.randn(len(context_lens), 3, heads, head_dim).to(DEVICE, dtype)
    query = qkv[:, 0]
    ours = decode_attention.self_attention(query, layer, metadata.self_block_tables, metadata.context_lens)
    reference = paged_attention(query, layer, metadata.self_block_tables, metadata, attn_mask=metadata.self_attn_mask)
    assert ours.shape == reference.shape and ours.dtype == dtype
    assert (ours.float() - reference.float()).abs().max().item() < TOLERANCE[dtype]


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_cross_attention_reads_each_rows_slot_like_the_gather_path(dtype):
    heads, head_dim, block_size, cross_len = 2, 16, 4, 70
    slot_tokens = math.ceil(cross_len / block_size) * block_size
    layer = _pool(6 * slot_tokens // block_size, block_size, heads, head_dim, dtype)
    # Slots out of order, siblings sharing one (rows 1 and 3), a slot no row uses (slot 1).
    cross_slots = [4, 0, 5, 0, 2]
    metadata = _metadata([1] * 5, [[0]] * 5, cross_slots, slot_tokens, cross_len, block_size)
    query = torch.randn(len(cross_slots), heads, head_dim).to(DEVICE, dtype)
    query[3] = query[1]
    ours = decode_attention.cross_attention(query, layer, metadata.cross_slot_ids, slot_tokens, cross_len)
    reference = cross_attention_gathered(query, layer, metadata)
    assert (ours.float() - reference.float()).abs().max().item() < TOLERANCE[dtype]
    assert torch.equal(ours[1], ours[3]), "the same query over the same slot: the same answer"


def test_a_decoder_step_through_the_kernels_matches_the_torch_path():
    """The whole decoder (self- and cross-attention, every layer) on a pure decode step, once
    with decode_kernels and once on the gather/in-place reference, over the same pool."""
    dims = WhisperDims(n_mels=80, n_audio_ctx=24, n_audio_state=32, n_audio_head=2, n_audio_layer=1,
                       n_vocab=100, n_text_ctx=32, n_text_state=32, n_text_head=2, n_text_layer=2)
    torch.manual_seed(0)
    decoder = TextDecoder(dims).to(DEVICE)
    with torch.no_grad():
        for parameter in decoder.parameters():
            parameter.normal_(0, 0.3)
    block_size, num_blocks = 4, 40
    slot_tokens = math.ceil(dims.n_audio_ctx / block_size) * block_size
    kv_cache = torch.randn(dims.n_text_layer, 2, num_blocks, block_size, dims.n_text_head, 16, device=DEVICE)
    encoder_out = torch.randn(3, dims.n_audio_ctx, dims.n_text_state, device=DEVICE)
    with torch.inference_mode():
        decoder.write_cross_kv(encoder_out, kv_cache, [0, 1, 2], slot_tokens)
        context_lens, tables = [3, 9, 6], [[20, 21], [22, 23, 24], [30, 26]]
        positions = torch.tensor([n - 1 for n in context_lens], device=DEVICE)
        slots = torch.tensor([t[(n - 1) // block_size] * block_size + (n - 1) % block_size
                              for t, n in zip(tables, context_lens)], device=DEVICE)
        input_ids = torch.tensor([7, 42, 99], device=DEVICE)
        outputs = []
        for kernels in (False, True):
            metadata = _metadata(context_lens, tables, [2, 0, 1], slot_tokens, dims.n_audio_ctx, block_size)
            metadata.slot_mapping = slots
            metadata.decode_kernels = kernels
            if not kernels:
                metadata.cross_runs = None  # the gathered reference
            outputs.append(decoder(input_ids, positions, kv_cache.clone(), metadata))
    assert (outputs[0] - outputs[1]).abs().max().item() < 1e-4


def test_decode_graph_buckets_cover_every_batch_size():
    assert bucket_sizes(1) == [1] and bucket_sizes(5) == [5]
    assert bucket_sizes(64) == [16, 32, 48, 64]
    for max_rows in (5, 100, 256):
        buckets = bucket_sizes(max_rows)
        assert buckets[-1] == max_rows
        assert all(next(b for b in buckets if b >= n) - n < 16 for n in range(1, max_rows + 1))
        assert buckets[0] >= min(16, max_rows), "no graph of fewer rows than an eager step's padding"


def test_only_rows_that_just_decode_are_graphed():
    from asrserve.engine.request import Request, SamplingParams

    def request(computed: int, word_timestamps: bool = False, no_speech_prob: float | None = 0.1) -> Request:
        made = Request("r", np.zeros(16000, np.float32), [1, 2, 3], SamplingParams(word_timestamps=word_timestamps), 50)
        made.output_token_ids = [5, 6]
        made.num_computed_tokens = computed
        made.no_speech_prob = no_speech_prob
        return made

    assert is_graphable(request(4))
    assert not is_graphable(request(0)), "prompt tokens"
    assert not is_graphable(request(4, word_timestamps=True)), "alignment scores"
    first = request(0, no_speech_prob=None)
    first.prompt_token_ids, first.output_token_ids = [1], []
    assert not is_graphable(first), "the no-speech probability is read at <|startoftranscript|>"
