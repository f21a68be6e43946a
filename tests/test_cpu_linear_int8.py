"""The encoder's int8 linear kernel on CPU (asrserve/model/cpu_linear_int8.py): the product it
defines (weights per output, rows quantized on the fly), how far that is from the exact product,
batch invariance, its epilogues, and the engine's use of it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from asrserve.model import cpu_linear, cpu_linear_int8
from asrserve.model.packed_linear import Int8KernelLinear, KernelLinear

needs_kernel = pytest.mark.skipif(not (cpu_linear.available() and cpu_linear_int8.available()),
                                  reason="needs AVX512-BF16, AVX512-VNNI and a C compiler")


def _weights(out_features: int, in_features: int, seed: int = 1):
    generator = torch.Generator().manual_seed(seed)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).bfloat16()
    bias = torch.randn(out_features, generator=generator)
    return weight, bias


def _rows(rows: int, in_features: int, seed: int = 2) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(rows, in_features, generator=generator)
    x[:, 3] *= 20  # an outlier channel, as LayerNorm outputs have
    x[::3] = x[::3].abs()  # rows all >= 0 (as after GELU, nearly): the range still spans 0
    return x.bfloat16()


def _quantized_rows(x: torch.Tensor) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The kernel's row quantization, step by step in float32: (q, step, zero) per row."""
    values = x.float().numpy()
    low = np.minimum(values.min(axis=1), 0).astype(np.float32)
    high = np.maximum(values.max(axis=1), 0).astype(np.float32)
    step = np.where(high > low, (high - low) / np.float32(255), np.float32(1)).astype(np.float32)
    inverse = (np.float32(1) / step).astype(np.float32)
    zero = np.rint(-low * inverse).astype(np.int64)
    q = np.clip(np.rint((values * inverse[:, None]).astype(np.float32)).astype(np.int64) + zero[:, None], 0, 255)
    return q, step, zero


def _defined_product(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """What the kernel computes before its epilogue's rounding, in float64: the exact sums of the
    quantized products, scaled."""
    q, step, zero = _quantized_rows(x)
    w8, w_scale = cpu_linear_int8.quantize(weight)
    sums = (q - zero[:, None]) @ w8.numpy().astype(np.int64).T
    y = torch.from_numpy(sums.astype(np.float64) * step[:, None].astype(np.float64)) * w_scale.double()
    return y if bias is None else y + bias.double()


@needs_kernel
@pytest.mark.parametrize("shape", [(384, 384), (1536, 384), (384, 1536), (48, 12)])
@pytest.mark.parametrize("rows", [1, 5, 6, 13, 200])
def test_the_product_is_the_quantized_sums_rounded_once(shape, rows):
    """Tiles of 1-6 rows and 1-4 blocks (48 outputs: three), against the product the
    quantization defines: within one bf16 rounding, and float32's few roundings of the scales."""
    weight, bias = _weights(*shape)
    x = _rows(rows, shape[1])
    ours = cpu_linear_int8.linear(x, cpu_linear_int8.pack(weight), bias)
    defined = _defined_product(x, weight, bias)
    assert ours.dtype == torch.bfloat16 and ours.shape == (rows, shape[0])
    assert (ours.double() - defined).abs().le(defined.abs() * (2.0**-8 + 2.0**-20) + 1e-6).all()


@needs_kernel
def test_the_error_stays_within_what_quantization_allows():
    """Against the exact product of the bf16 inputs, each output is off by at most what rounding
    each input to half a step and each weight to half its step can add up to, plus the final
    rounding; and the error is a few tenths of a percent of the output, not more."""
    weight, bias = _weights(1536, 384)
    x = _rows(300, 384)
    ours = cpu_linear_int8.linear(x, cpu_linear_int8.pack(weight), bias).double()
    exact = x.double() @ weight.double().T + bias.double()
    _, step, _ = _quantized_rows(x)
    _, w_scale = cpu_linear_int8.quantize(weight)
    x_step, w_step = torch.from_numpy(step).double()[:, None], w_scale.double()[None, :]
    bound = (weight.double().abs().sum(1)[None, :] * x_step / 2 + x.double().abs().sum(1)[:, None] * w_step / 2
             + x.shape[1] * x_step * w_step / 4)
    assert (ours - exact).abs().le(bound + exact.abs() * 2.0**-8 + 1e-6).all()
    assert (ours - exact).norm() / exact.norm() < 0.02


@needs_kernel
def test_rows_have_the_same_bits_at_every_row_count():
    """Each row's quantization and its int32 sums depend on that row alone."""
    weight, bias = _weights(1536, 384)
    packed = cpu_linear_int8.pack(weight)
    x = _rows(300, 384, seed=3)
    residual = torch.randn(300, 1536, generator=torch.Generator().manual_seed(4)).bfloat16()
    for epilogue in ({}, {"gelu": True}, {"residual": residual}):
        full = cpu_linear_int8.linear(x, packed, bias, **epilogue)
        for rows in (1, 2, 3, 5, 6, 7, 13, 64):
            part = {k: (v[:rows] if k == "residual" else v) for k, v in epilogue.items()}
            assert torch.equal(cpu_linear_int8.linear(x[:rows], packed, bias, **part), full[:rows])
        assert torch.equal(cpu_linear_int8.linear(x[150:151], packed, bias,
                                                  **{k: (v[150:151] if k == "residual" else v)
                                                     for k, v in epilogue.items()})[0], full[150])


@needs_kernel
def test_the_epilogues_apply_to_the_same_sums_before_the_one_rounding():
    weight, bias = _weights(1536, 384)
    x = _rows(40, 384, seed=5)
    packed = cpu_linear_int8.pack(weight)
    defined = _defined_product(x, weight, bias)
    gelu = cpu_linear_int8.linear(x, packed, bias, gelu=True).double()
    exact_gelu = torch.nn.functional.gelu(defined)
    assert (gelu - exact_gelu).abs().le(exact_gelu.abs() * (2.0**-8 + 2.0**-20) + 1e-5).all()
    residual = torch.randn(40, 1536, generator=torch.Generator().manual_seed(6)).bfloat16()
    added = cpu_linear_int8.linear(x, packed, bias, residual=residual).double()
    exact_sum = defined + residual.double()
    assert (added - exact_sum).abs().le(exact_sum.abs() * 2.0**-8 + 1e-5).all()
    with pytest.raises(AssertionError):
        cpu_linear_int8.linear(x, packed, bias, gelu=True, residual=residual)


@needs_kernel
def test_what_it_takes():
    assert cpu_linear_int8.takes(torch.zeros(384, 384, dtype=torch.bfloat16))
    assert not cpu_linear_int8.takes(torch.zeros(384, 384))  # float32
    assert not cpu_linear_int8.takes(torch.zeros(40, 384, dtype=torch.bfloat16))  # not a multiple of 16 outputs
    assert not cpu_linear_int8.takes(torch.zeros(384, 386, dtype=torch.bfloat16))  # inputs not a multiple of 4
    zero_rows = cpu_linear_int8.linear(torch.zeros(0, 384, dtype=torch.bfloat16),
                                       cpu_linear_int8.pack(torch.ones(16, 384, dtype=torch.bfloat16)), None)
    assert zero_rows.shape == (0, 16)
    # A row of zeros: step 1, every input exactly 0, the output exactly the bias.
    weight, bias = _weights(16, 384)
    out = cpu_linear_int8.linear(torch.zeros(2, 384, dtype=torch.bfloat16), cpu_linear_int8.pack(weight), bias)
    assert torch.equal(out, bias.bfloat16().expand(2, -1))


def _engine(**model):
    from asrserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from asrserve.engine.engine_core import EngineCore

    return EngineCore(EngineConfig(ModelConfig(dtype="bfloat16", **model), CacheConfig(num_kv_blocks=256 * 8),
                                   SchedulerConfig(max_num_seqs=8)))


@needs_kernel
def test_the_bf16_cpu_engine_runs_its_encoder_linears_in_int8_unless_told_not_to():
    quantized, plain = _engine(), _engine(encoder_quantization="none")
    for engine, kind in ((quantized, Int8KernelLinear), (plain, KernelLinear)):
        encoder = engine.runner.model.encoder
        assert engine.runner.encode is encoder  # eager, over the kernels
        linears = [m for m in encoder.modules() if isinstance(m, (torch.nn.Linear, KernelLinear))]
        assert len(linears) == 4 * len(encoder.layers) and all(type(m) is kind for m in linears)
    assert quantized.runner.encoder_int8 and not plain.runner.encoder_int8
    # The decoder stays in bf16 either way.
    assert not any(isinstance(m, Int8KernelLinear) for m in quantized.runner.model.decoder.modules())


def test_int8_is_refused_where_it_cannot_run():
    from asrserve.config import ModelConfig

    with pytest.raises(ValueError, match="--compile on"):
        ModelConfig(encoder_quantization="int8", compile="on")
    with pytest.raises(ValueError, match="unknown encoder quantization"):
        ModelConfig(encoder_quantization="fp8")
    with pytest.raises(ValueError, match="needs bfloat16"):
        _engine_float32_int8()


def _engine_float32_int8():
    from asrserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
    from asrserve.engine.engine_core import EngineCore

    return EngineCore(EngineConfig(ModelConfig(dtype="float32", encoder_quantization="int8"),
                                   CacheConfig(num_kv_blocks=256), SchedulerConfig(max_num_seqs=4)))


@needs_kernel
def test_int8_transcripts_are_as_good_as_bf16_ones(speech_audio):
    """The test sentences, decoded greedily with the encoder's linears in int8 and in bf16: no
    more word errors than bf16's plus one, over all of them."""
    from asrserve import ASR
    from asrserve.benchmark.wer import english_normalizer, word_errors
    from tests.conftest import SENTENCES

    normalize = english_normalizer()
    errors = {}
    for quantization in ("int8", "none"):
        asr = ASR(dtype="bfloat16", encoder_quantization=quantization, max_num_seqs=16)
        texts = [t.text for t in asr.transcribe(speech_audio, fallback=False)]
        errors[quantization] = sum(word_errors(normalize(ref).split(), normalize(hyp).split())
                                   for ref, hyp in zip(SENTENCES, texts, strict=True))
    assert errors["int8"] <= errors["none"] + 1, errors
