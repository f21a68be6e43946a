"""The encoder's linear layers on CPU in int8: weights quantized once per output, each input row
quantized on the fly, int32 sums by AVX512-VNNI (csrc/linear_int8.c).

Why: on CPU the encoder is most of a short clip's cost (a 30 s window however short the clip),
and in bf16 its linears already run at the cores' bf16 rate (~440 GFLOP/s on 2 Zen 4 cores,
cpu_linear.py). VPDPBUSD multiplies twice as many pairs per instruction as VDPBF16PS, so int8
is the one way left to make them quicker. Only the encoder's linears: its attention, the
convolutions and the whole decoder (whose logits decide tokens, timestamps and fallback) stay
in bf16.

Accuracy: the weights are quantized symmetrically per output (w ~ w_scale * w8, w8 in
-127 ... 127), each row of activations asymmetrically over its own range including 0 (x ~
scale * (q - zero), q in 0 ... 255: a row's outliers cost only that row's precision). What
that does to transcripts is measured, not assumed: docs/benchmarks.md gives WER with and
without it on every long-form set and the mixed clips; `--encoder-quantization none` keeps
the encoder's linears in bf16.

Every sum is exact in int32 and a row's quantization depends on that row alone, so a row's
result does not depend on the batch.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from asrserve.model import cpu_kernels
from asrserve.model.cpu_linear import Operands


def _kernel():
    return cpu_kernels.load("linear_int8.c", "asrserve_linear_int8",
                            (ctypes.c_void_p,) * 5 + (ctypes.c_int,) + (ctypes.c_void_p,) * 2
                            + (ctypes.c_int64,) * 3 + (ctypes.c_int,), extra_flags=("-mavx512vnni",))


def available() -> bool:
    return torch.cpu._is_vnni_supported() and _kernel() is not None


def takes(weight: torch.Tensor) -> bool:
    """Whether the kernel takes this weight [out, in]: bf16 on CPU (the model runs bf16, which
    the kernel reads and writes), inputs a multiple of 4 and outputs of 16 (every Whisper
    encoder linear)."""
    out_features, in_features = weight.shape
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and in_features % 4 == 0
            and out_features % 16 == 0 and available())


@dataclass(frozen=True)
class Int8Weight:
    """A weight [out, in] as the kernel reads it."""

    packed: torch.Tensor  # int8 [out / 16, in / 4, 16, 4]: four inputs' weights for 16 outputs
    scale: torch.Tensor  # float32 [out]: weight ~ scale * int8 weight, per output
    sums: torch.Tensor  # int32 [out]: each output's int8 weights summed (the zero-point term)

    @property
    def shape(self) -> tuple[int, int]:
        blocks, quads = self.packed.shape[:2]
        return 16 * blocks, 4 * quads


def quantize(weight: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """weight [out, in] -> (int8 weight, float32 scale per output), symmetric: weight ~ scale *
    int8 weight, the largest magnitude of each output's weights at 127."""
    weight = weight.detach().float()
    scale = weight.abs().amax(dim=1).clamp_min(torch.finfo(torch.float32).tiny) / 127
    return torch.round(weight / scale[:, None]).clamp(-127, 127).to(torch.int8), scale


def pack(weight: torch.Tensor) -> Int8Weight:
    quantized, scale = quantize(weight)
    out_features, in_features = quantized.shape
    blocks = quantized.reshape(out_features // 16, 16, in_features // 4, 4).permute(0, 2, 1, 3).contiguous()
    return Int8Weight(blocks, scale.contiguous(), quantized.sum(dim=1, dtype=torch.int32).contiguous())


def linear(x: torch.Tensor, weight: Int8Weight, bias: torch.Tensor | None, *, gelu: bool = False,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] bf16 @ the weight's transpose, plus bias (float32 or None) -> [..., out] bf16;
    then GELU (exact, erf) if gelu, or plus residual [..., out] (bf16) if given, in float32
    before the one rounding."""
    kernel = _kernel()
    assert kernel is not None, "the kernel is not available here (see available())"
    out_features, in_features = weight.shape
    operands = Operands.of(x, in_features, out_features, gelu, residual)
    status = kernel(operands.rows.data_ptr(), weight.packed.data_ptr(), weight.scale.data_ptr(),
                    weight.sums.data_ptr(), 0 if bias is None else bias.data_ptr(), operands.epilogue,
                    operands.residual_ptr, operands.out.data_ptr(), operands.rows.shape[0], in_features,
                    out_features, torch.get_num_threads())
    if status == 2:
        raise MemoryError(f"int8 linear kernel: no memory for {operands.rows.shape[0]} quantized rows")
    if status != 0:
        raise RuntimeError(f"int8 linear kernel refused a {out_features}x{in_features} product")
    return operands.result(x)
