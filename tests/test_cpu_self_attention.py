"""The C kernel for bf16 self-attention on CPU (asrserve/model/cpu_self_attention.py), against
float32 attention, against the torch path it replaces, and inside a decoder step."""

from __future__ import annotations

import random

import pytest
import torch

from asrserve.model import cpu_self_attention
from asrserve.model.attention import _attention_16bit_cpu
from tests.conftest import decoding_request

needs_kernel = pytest.mark.skipif(not cpu_self_attention.available(), reason="needs AVX512-BF16 and a C compiler")

BLOCK_SIZE = 16


def _pool(num_blocks: int, heads: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    pool = torch.randn(2, num_blocks, BLOCK_SIZE, heads, head_dim, generator=generator)
    pool[0] *= 3  # keys scaled up so that the softmax is peaked, as real attention often is
    return pool.bfloat16()


def _tables(lengths: list[int], num_blocks: int, seed: int = 0) -> torch.Tensor:
    """Each sequence's blocks, drawn without replacement from the pool in no order (a pool
    after many requests came and went); unused entries 0."""
    blocks = list(range(num_blocks))
    random.Random(seed).shuffle(blocks)
    width = max(-(-length // BLOCK_SIZE) for length in lengths)
    tables = torch.zeros(len(lengths), width, dtype=torch.int64)
    for row, length in enumerate(lengths):
        for column in range(-(-length // BLOCK_SIZE)):
            tables[row, column] = blocks.pop()
    return tables


def _float32_attention(query, pool, tables, token_seqs, token_keys):
    """Token by token, in float32 from the same bf16 inputs."""
    heads, head_dim = query.shape[1:]
    rows = []
    for token, (seq, keys) in enumerate(zip(token_seqs.tolist(), token_keys.tolist())):
        slots = torch.tensor([tables[seq, j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE for j in range(keys)])
        k = pool[0].reshape(-1, heads, head_dim)[slots].float().transpose(0, 1)  # [H, keys, D]
        v = pool[1].reshape(-1, heads, head_dim)[slots].float().transpose(0, 1)
        scores = (query[token].float()[:, None, :] @ k.transpose(-1, -2)) / head_dim**0.5  # [H, 1, keys]
        rows.append((scores.softmax(-1) @ v).reshape(-1))
    return torch.stack(rows)


def _step(lengths: list[int], new_tokens: list[int], heads: int = 6, head_dim: int = 64, seed: int = 0):
    """A step over sequences of `lengths` keys (after this step) bringing `new_tokens` tokens each:
    the flat queries, pool, tables and the kernel's per-token indices."""
    num_blocks = sum(-(-length // BLOCK_SIZE) for length in lengths) + 5
    pool = _pool(num_blocks, heads, head_dim, seed)
    tables = _tables(lengths, num_blocks, seed)
    token_seqs = torch.tensor([s for s, n in enumerate(new_tokens) for _ in range(n)], dtype=torch.int64)
    token_keys = torch.tensor([lengths[s] - n + i + 1 for s, n in enumerate(new_tokens) for i in range(n)],
                              dtype=torch.int64)
    generator = torch.Generator().manual_seed(seed + 1)
    query = torch.randn(len(token_seqs), heads, head_dim, generator=generator).bfloat16()
    return query, pool, tables, token_seqs, token_keys


@needs_kernel
@pytest.mark.parametrize("head_dim", [64, 80])
def test_the_kernel_is_float32_attention_rounded_once(head_dim):
    """Decoding rows, a prompt's rows (causal within the step) and a draft check's rows, over
    scattered blocks: float32 attention rounded to bf16 at the end, closer to it than the torch
    path (which rounds the scores to bf16 first)."""
    lengths, new_tokens = [45, 3, 30, 17], [1, 3, 4, 1]
    query, pool, tables, token_seqs, token_keys = _step(lengths, new_tokens, head_dim=head_dim)
    ours = cpu_self_attention.self_attention(query, pool, tables, token_seqs, token_keys)
    reference = _float32_attention(query, pool, tables, token_seqs, token_keys)
    assert ours.shape == (len(token_seqs), 6 * head_dim) and ours.dtype == torch.bfloat16
    error = (ours.float() - reference).abs().max().item()
    assert error <= 2 ** -7 * reference.abs().max().item()
    # The torch path, token by token over the same gathered keys.
    torch_rows = []
    for token, (seq, keys) in enumerate(zip(token_seqs.tolist(), token_keys.tolist())):
        slots = torch.tensor([tables[seq, j // BLOCK_SIZE] * BLOCK_SIZE + j % BLOCK_SIZE for j in range(keys)])
        k = pool[0].reshape(-1, 6, head_dim)[slots].transpose(0, 1)[None]
        v = pool[1].reshape(-1, 6, head_dim)[slots].transpose(0, 1)[None]
        torch_rows.append(_attention_16bit_cpu(query[token][None, :, None, :], k, v, None).reshape(-1))
    torch_error = (torch.stack(torch_rows).float() - reference).abs().max().item()
    assert error < torch_error


@needs_kernel
def test_a_tokens_output_does_not_depend_on_the_rest_of_the_step():
    """Batch invariance: a sequence decoding beside 30 others, or a prompt row beside its own
    prompt's other rows, gets the bits it gets alone."""
    lengths = [random.Random(2).randrange(5, 120) for _ in range(31)]
    new_tokens = [1] * 30 + [7]
    query, pool, tables, token_seqs, token_keys = _step(lengths, new_tokens, seed=2)
    together = cpu_self_attention.self_attention(query, pool, tables, token_seqs, token_keys)
    for token in (0, 13, 29, 30, 36):
        alone = cpu_self_attention.self_attention(query[token:token + 1], pool, tables[token_seqs[token]][None],
                                                  torch.zeros(1, dtype=torch.int64), token_keys[token:token + 1])
        assert torch.equal(alone[0], together[token])


@needs_kernel
def test_keys_past_a_tokens_position_are_never_read():
    """Causal: a token sees its own key and those before; later keys in its blocks (the prompt's
    next rows, stale data from an earlier request, NaN) must not reach it."""
    query, pool, tables, token_seqs, token_keys = _step([20], [1])
    clean = cpu_self_attention.self_attention(query, pool, tables, token_seqs, token_keys)
    last_block = tables[0, 1]
    pool[:, last_block, 20 - BLOCK_SIZE:] = float("nan")
    assert torch.equal(cpu_self_attention.self_attention(query, pool, tables, token_seqs, token_keys), clean)


@needs_kernel
@pytest.mark.parametrize("bad", ["keys", "block", "sequence"])
def test_out_of_range_indices_are_refused(bad):
    """A key count past the table, a block id past the pool or a token's sequence past the
    tables is a bug upstream: refused loudly, never read out of bounds."""
    query, pool, tables, token_seqs, token_keys = _step([20, 40], [1, 1])
    if bad == "keys":
        token_keys[0] = tables.shape[1] * BLOCK_SIZE + 1
    elif bad == "block":
        tables[1, 2] = pool.shape[1]
    else:
        token_seqs[1] = 2
    with pytest.raises(RuntimeError, match="refused"):
        cpu_self_attention.self_attention(query, pool, tables, token_seqs, token_keys)


@needs_kernel
def test_a_decoder_step_through_the_kernel_matches_the_torch_path():
    """The decoder's self-attention through the kernel (DecoderInputBuilder(cpu_self_kernel=True))
    against paged_attention's gather path, in bf16: decoding requests, one mid-prompt, siblings
    sharing prompt blocks."""
    from asrserve.engine.block_manager import BlockManager
    from asrserve.engine.request import Request
    from asrserve.model.whisper import Whisper, WhisperDims
    from asrserve.worker.input_batch import DecoderInputBuilder

    cross_len = 100
    dims = WhisperDims(n_mels=80, n_audio_ctx=cross_len, n_audio_state=64, n_audio_head=4, n_audio_layer=1,
                       n_vocab=300, n_text_ctx=96, n_text_state=256, n_text_head=4, n_text_layer=2)
    model = Whisper(dims)
    model.init_random_weights(seed=3)
    model = model.to(torch.bfloat16).eval()
    blocks = BlockManager(num_blocks=12 * 7 + 40, block_size=BLOCK_SIZE, cross_len=cross_len)
    kv_cache = torch.randn(2, 2, blocks.num_blocks, BLOCK_SIZE, 4, 64, generator=torch.Generator().manual_seed(4))
    kv_cache = kv_cache.bfloat16()
    rng = random.Random(5)

    def new_request(name: str, num_computed: int, num_tokens: int) -> Request:
        return decoding_request(name, num_computed, num_tokens, rng)

    batch = [new_request(f"r{i}", length - 1, length) for i, length in enumerate((40, 5, 33, 17))]
    batch.append(new_request("prefill", 3, 9))  # mid-prompt: six rows
    for request in batch:
        blocks.admit(request)
    sibling = new_request("sibling", 39, 40)
    blocks.share(batch[0], sibling, 32)
    blocks.grow(sibling)
    batch.append(sibling)

    hidden = {}
    for kernel in (False, True):
        builder = DecoderInputBuilder(BLOCK_SIZE, cross_len, 0, {}, torch.device("cpu"), cpu_self_kernel=kernel)
        inputs = builder.build(batch)
        assert (inputs.metadata.self_attn_mask is None) == kernel
        with torch.inference_mode():
            hidden[kernel] = model.decoder(inputs.input_ids, inputs.positions, kv_cache.clone(), inputs.metadata).float()
    assert hidden[True].shape == hidden[False].shape == (4 + 6 + 1, 256)  # four decoding rows, six prompt rows, the sibling
    assert (hidden[True] - hidden[False]).abs().max() < 0.05 * hidden[False].abs().max()
