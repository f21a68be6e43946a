"""The C kernel for the decoder's bf16 linears on CPU (asrserve/model/cpu_linear.py), against
float32 products and oneDNN's packed path, and in the model."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from asrserve.model import cpu_linear
from asrserve.model.packed_linear import KernelLinear, pack_decoder_linears, pack_weight, packed_linear

needs_kernel = pytest.mark.skipif(not cpu_linear.available(), reason="needs AVX512-BF16 and a C compiler")


def _weights(out_features: int, in_features: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).bfloat16()
    bias = torch.randn(out_features, generator=generator).bfloat16()
    return weight, bias


@needs_kernel
@pytest.mark.parametrize("shape", [(384, 384), (1152, 384), (1536, 384), (384, 1536), (48, 10)])
@pytest.mark.parametrize("rows", [1, 5, 6, 13, 200])
def test_the_product_is_float32_sums_rounded_once(shape, rows):
    """Tiles of 1-6 rows and 1-4 blocks of 16 outputs (48 outputs: a tile of three), against the
    float32 product of the same bf16 inputs: one rounding to bf16 off, as oneDNN's."""
    weight, bias = _weights(*shape)
    x = torch.randn(rows, shape[1], generator=torch.Generator().manual_seed(2)).bfloat16()
    ours = cpu_linear.linear(x, cpu_linear.pack(weight), bias.float())
    reference = x.float() @ weight.float().T + bias.float()
    assert ours.dtype == torch.bfloat16 and ours.shape == (rows, shape[0])
    torch.testing.assert_close(ours.float(), reference, rtol=2 ** -8, atol=1e-6)
    packed = pack_weight(weight)
    if packed is not None:  # about as far from the float32 product as oneDNN's own
        theirs = packed_linear(x, packed, bias).float()
        assert (ours.float() - reference).abs().max() <= 1.01 * (theirs - reference).abs().max() + 1e-6


@needs_kernel
def test_rows_have_the_same_bits_at_every_row_count():
    """Batch invariance without padding: a row alone, in a short step, or anywhere in a 300-row
    prompt gets the same bits (every tile shape in between)."""
    weight, bias = _weights(1152, 384)
    packed, bias = cpu_linear.pack(weight), bias.float()
    x = torch.randn(300, 384, generator=torch.Generator().manual_seed(3)).bfloat16()
    full = cpu_linear.linear(x, packed, bias)
    for rows in (1, 2, 3, 4, 5, 6, 7, 8, 12, 17, 33, 64):
        assert torch.equal(cpu_linear.linear(x[:rows], packed, bias), full[:rows])
    for row in (7, 150, 299):
        assert torch.equal(cpu_linear.linear(x[row:row + 1], packed, bias)[0], full[row])
    assert torch.equal(cpu_linear.linear(x.view(3, 100, 384), packed, bias).view(300, -1), full)


@needs_kernel
def test_shapes_it_cannot_take_are_left_to_onednn():
    assert cpu_linear.takes(torch.zeros(384, 384, dtype=torch.bfloat16))
    assert not cpu_linear.takes(torch.zeros(384, 384))  # float32
    assert not cpu_linear.takes(torch.zeros(40, 384, dtype=torch.bfloat16))  # not a multiple of 16 outputs
    assert not cpu_linear.takes(torch.zeros(384, 383, dtype=torch.bfloat16))  # odd inputs


@needs_kernel
def test_the_bf16_decoder_runs_its_linears_through_the_kernel():
    """pack_decoder_linears puts every decoder linear and the output projection on the kernel in
    bf16, and the decoder computes what it did."""
    from asrserve.model.whisper import Whisper, WhisperDims

    dims = WhisperDims(n_mels=80, n_audio_ctx=100, n_audio_state=64, n_audio_head=4, n_audio_layer=1,
                       n_vocab=300, n_text_ctx=64, n_text_state=128, n_text_head=2, n_text_layer=2)
    model = Whisper(dims)
    model.init_random_weights(seed=3)
    model = model.to(torch.bfloat16).eval()
    x = torch.randn(9, 128, generator=torch.Generator().manual_seed(4)).bfloat16()
    with torch.inference_mode():
        expected = model.decoder.layers[1].mlp(x).float()
    if not pack_decoder_linears(model):
        pytest.skip("this CPU's oneDNN cannot pack the output projection")
    linears = [m for m in model.decoder.modules() if isinstance(m, (nn.Linear, KernelLinear))]
    assert linears and all(isinstance(m, KernelLinear) for m in linears)
    assert model.decoder.output_kernel and model.decoder.logits_rounded
    with torch.inference_mode():
        got = model.decoder.layers[1].mlp(x).float()
        logits = model.decoder.compute_logits(x)
    assert (got - expected).abs().max() <= 0.02 * expected.abs().max()
    # The output projection through the kernel, its 300 tokens padded to 304 and cut back:
    # float32 logits rounded to bf16, as oneDNN's product is (rounded_logits.py refines them).
    exact = x.float() @ model.decoder.embed_tokens.weight.float().T
    assert logits.shape == (9, 300) and logits.dtype == torch.float32
    assert ((logits - exact).abs() <= exact.abs() * 2.0**-8 + 1e-6).all()
    with pytest.raises(RuntimeError, match="cannot be moved or cast"):
        model.decoder.float()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 7, 1500])
def test_the_gelu_epilogue_is_exact_gelu_rounded_once(rows):
    """fc1's GELU in the kernel's epilogue: float64 GELU of the float32 product, within one bf16
    rounding where it matters (|y| >= 1e-3; below that the error stays under 1e-5), and as close
    as torch's product followed by torch's bf16 GELU (two roundings) or closer."""
    weight, bias = _weights(1536, 384)
    x = torch.randn(rows, 384, generator=torch.Generator().manual_seed(5)).bfloat16()
    ours = cpu_linear.linear(x, cpu_linear.pack(weight), bias.float(), gelu=True).float()
    exact = torch.nn.functional.gelu((x.float() @ weight.float().T + bias.float()).double()).float()
    theirs = torch.nn.functional.gelu(torch.nn.functional.linear(x, weight, bias)).float()
    assert (ours - exact).abs().le(exact.abs() * 2.0**-8 + 1e-5).all()
    assert (ours - exact).abs().mean() <= (theirs - exact).abs().mean()
    # Its whole range, row by row through an identity weight: the negative tail included.
    grid = torch.linspace(-12, 12, 16 * 1000).reshape(-1, 16).bfloat16()
    through = cpu_linear.linear(grid, cpu_linear.pack(torch.eye(16).bfloat16()), None, gelu=True).float()
    exact = torch.nn.functional.gelu(grid.double()).float()
    assert (through - exact).abs().le(exact.abs() * 2.0**-8 + 1e-6).all()


@needs_kernel
@pytest.mark.parametrize("rows", [1, 6, 1500])
def test_the_residual_epilogue_adds_before_the_one_rounding(rows):
    """out_proj's and fc2's residual add in the epilogue: the float32 sum of product, bias and
    residual rounded once, closer to it than torch's two roundings."""
    weight, bias = _weights(384, 1536)
    generator = torch.Generator().manual_seed(6)
    x = torch.randn(rows, 1536, generator=generator).bfloat16()
    residual = torch.randn(rows, 384, generator=generator).bfloat16()
    ours = cpu_linear.linear(x, cpu_linear.pack(weight), bias.float(), residual=residual).float()
    exact = (x.double() @ weight.double().T + bias.double() + residual.double()).float()
    theirs = (residual + torch.nn.functional.linear(x, weight, bias)).float()
    # atol: float32 sums of 1536 products, where the residual cancels the product
    torch.testing.assert_close(ours, exact, rtol=2 ** -8, atol=1e-5)
    assert (ours - exact).abs().mean() < (theirs - exact).abs().mean()


@needs_kernel
def test_epilogue_rows_have_the_same_bits_at_every_row_count_and_are_checked():
    weight, bias = _weights(384, 384)
    packed, bias = cpu_linear.pack(weight), bias.float()
    generator = torch.Generator().manual_seed(7)
    x, residual = torch.randn(2, 50, 384, generator=generator).bfloat16()
    for epilogue in ({"gelu": True}, {"residual": residual}):
        full = cpu_linear.linear(x, packed, bias, **epilogue)
        for rows in (1, 5, 13):
            part = {k: (v[:rows] if k == "residual" else v) for k, v in epilogue.items()}
            assert torch.equal(cpu_linear.linear(x[:rows], packed, bias, **part), full[:rows])
    with pytest.raises(AssertionError):
        cpu_linear.linear(x, packed, bias, gelu=True, residual=residual)
    with pytest.raises(AssertionError):
        cpu_linear.linear(x, packed, bias, residual=residual[:, :16])


@needs_kernel
def test_the_bf16_cpu_engine_runs_its_encoder_over_the_kernel_with_its_epilogues():
    """The runner (bf16 on CPU, --compile auto, --encoder-quantization none) swaps the encoder's
    linears for the kernel's and runs the encoder eagerly; its output is as close to float32's
    as the torch path's. (By default they run in int8: tests/test_cpu_linear_int8.py.)"""
    from asrserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from asrserve.engine.engine_core import EngineCore

    engine = EngineCore(EngineConfig(ModelConfig(dtype="bfloat16", encoder_quantization="none"),
                                     CacheConfig(num_kv_blocks=256),
                                     SchedulerConfig(max_num_seqs=4)))
    runner = engine.runner
    encoder = runner.model.encoder
    assert runner.encode is encoder
    linears = [m for m in encoder.modules() if isinstance(m, (nn.Linear, KernelLinear))]
    assert len(linears) == 4 * len(encoder.layers) and all(type(m) is KernelLinear for m in linears)
    from asrserve.model.loader import load_model

    cpu = torch.device("cpu")
    reference = load_model(ModelConfig(), cpu, torch.float32).model.encoder
    torch_path = load_model(ModelConfig(), cpu, torch.bfloat16).model.encoder
    mel = torch.randn(1, 80, 3000, generator=torch.Generator().manual_seed(8))
    with torch.inference_mode():
        exact = reference(mel)
        ours, theirs = encoder(mel.bfloat16()).float(), torch_path(mel.bfloat16()).float()
    assert ((ours - exact).norm() / exact.norm()) <= 1.1 * ((theirs - exact).norm() / exact.norm())
