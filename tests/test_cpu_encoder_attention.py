"""The C kernel for the encoder's bf16 self-attention on CPU (asrserve/model/cpu_encoder_attention.py),
against float32 attention and the torch path it replaces, and in the compiled encoder."""

from __future__ import annotations

import pytest
import torch

from asrserve.model import cpu_encoder_attention
from asrserve.model.whisper import attention_by_head

needs_kernel = pytest.mark.skipif(not cpu_encoder_attention.available(), reason="needs AVX512-BF16 and a C compiler")


def _qkv(batch: int, length: int, heads: int, head_dim: int, seed: int = 0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    qkv = torch.randn(batch, length, 3, heads, head_dim, generator=generator)
    qkv[:, :, 1] *= 2  # keys scaled up so that the softmax is peaked, as real attention often is
    return qkv.bfloat16()


@needs_kernel
@pytest.mark.parametrize("length,head_dim", [(1500, 64), (37, 64), (100, 80), (5, 16)],
                         ids=["whisper-window", "short", "five-blocks", "tiny"])
def test_the_kernel_is_closer_to_float32_than_the_torch_path(length, head_dim):
    """Lengths that are not a multiple of 16 (the packed keys' padding must weigh nothing),
    head widths of 1-5 blocks of 16: float32 attention within bf16 rounding, and closer to it
    than the torch path, which rounds the scores to bf16."""
    qkv = _qkv(2, length, 3, head_dim)
    with torch.inference_mode():
        ours = cpu_encoder_attention.encoder_attention(qkv)
        reference = attention_by_head(qkv.float())
        theirs = attention_by_head(qkv)
    assert ours.shape == (2, length, 3, head_dim) and ours.dtype == torch.bfloat16
    error = (ours.float() - reference).abs().max().item()
    assert error <= 2 ** -6 * reference.abs().max().item()
    if length >= 16:  # over a handful of keys both are mostly the output's own rounding
        assert error < (theirs.float() - reference).abs().max().item()


@needs_kernel
def test_an_audios_output_does_not_depend_on_the_batch():
    """Batch invariance: an audio encoded beside two others gets the bits it gets alone."""
    qkv = _qkv(3, 200, 4, 64, seed=2)
    with torch.inference_mode():
        together = cpu_encoder_attention.encoder_attention(qkv)
        for audio in range(3):
            alone = cpu_encoder_attention.encoder_attention(qkv[audio:audio + 1].contiguous())
            assert torch.equal(alone[0], together[audio])


@needs_kernel
def test_the_compiled_bf16_encoder_calls_the_kernel(monkeypatch):
    """The compiled encoder runs the kernel as one opaque op (a custom op, no graph break) and
    gives what the eager encoder gives with it."""
    from asrserve.model.encoder_compile import compiled_encoder
    from asrserve.model.whisper import Whisper, WhisperDims

    dims = WhisperDims(n_mels=80, n_audio_ctx=1500, n_audio_state=64, n_audio_head=4, n_audio_layer=2,
                       n_vocab=300, n_text_ctx=64, n_text_state=64, n_text_head=4, n_text_layer=1)
    model = Whisper(dims)
    model.init_random_weights(seed=1)
    encoder = model.to(torch.bfloat16).eval().encoder
    calls = []
    kernel = cpu_encoder_attention._kernel()
    monkeypatch.setattr(cpu_encoder_attention, "_kernel", lambda: calls.append(1) or kernel)
    mel = torch.randn(2, 80, 3000, generator=torch.Generator().manual_seed(2)).bfloat16()
    with torch.inference_mode():
        eager = encoder(mel)
        assert len(calls) == 2  # one per layer
        encode = compiled_encoder(encoder, 80, torch.device("cpu"), torch.bfloat16, "on")
        calls.clear()
        compiled = encode(mel)
    assert len(calls) == 2 * 2, "each audio's two layers ran the kernel"
    assert (compiled.float() - eager.float()).abs().max() <= 0.05 * eager.float().abs().max()
