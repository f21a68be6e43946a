"""The linear layers on CPU in bfloat16, as a small C kernel (csrc/): the decoder's for a
step's few rows, and the encoder's, whose GELU and residual adds it applies on the way out.

A decode step multiplies a handful of rows (one per decoding sequence) by each decoder weight:
memory-bound work, ideally one read of the weights. oneDNN's packed product
(packed_linear.py) has a fixed cost of ~20-30 us a call on 2 AVX512-BF16 cores, more than
reading a 384 x 384 weight takes, and tiny.en's step makes 24 such calls: at one request the
decoder's linears were ~28% of the step. The kernel streams each weight once for all the rows
(tiles of up to 6 rows by 64 outputs whose sums stay in registers), with float32 sums and one
rounding to bf16, as oneDNN's.

Every output is its row's products added in input order in one vector lane, whatever tile it
falls in, so a row's result does not depend on how many rows the step has (batch invariance,
without padding). A weight is packed once at start-up into pairs of inputs per 16 outputs
(pack), the layout the VDPBF16PS instruction reads.

The encoder's products (1500 rows) run at oneDNN's speed, and the kernel applies what follows
them before its one rounding to bf16: the GELU after the feed-forward's first layer, and the
residual add after the attention's and the feed-forward's last (epilogues). Each of those was
its own pass over a [1500, 1536] or [1500, 384] tensor: on 2 cores the GELU alone took 1-3.5 ms
of a ~120 ms window, as long as reading and writing its tensor from memory takes, and torch's
addmm first copies the bias into every row of its output.

packed_linear.KernelLinear is the module over it. Built and loaded by cpu_kernels.py; where it
cannot run (no AVX512-BF16, no C compiler, ASRSERVE_CPU_KERNELS=0) the oneDNN path serves.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass

import torch

from asrserve.model import cpu_kernels


def _kernel():
    return cpu_kernels.load("linear_bf16.c", "asrserve_linear_bf16",
                            (ctypes.c_void_p,) * 3 + (ctypes.c_int,) + (ctypes.c_void_p,) * 2
                            + (ctypes.c_int64,) * 3 + (ctypes.c_int,))


# The kernels' epilogues (csrc/linear_epilogue.h).
_NONE, _GELU, _RESIDUAL = 0, 1, 2


def available() -> bool:
    return _kernel() is not None


def takes(weight: torch.Tensor) -> bool:
    """Whether the kernel takes this weight [out, in]: bf16 on CPU, an even input width and a
    multiple of 16 outputs (every Whisper decoder linear)."""
    out_features, in_features = weight.shape
    return (weight.dtype == torch.bfloat16 and weight.device.type == "cpu" and in_features % 2 == 0
            and out_features % 16 == 0 and available())


def pack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] -> [out / 16, in / 2, 16, 2]: for each block of 16 outputs, each pair of inputs'
    weights side by side."""
    out_features, in_features = weight.shape
    blocks = weight.detach().reshape(out_features // 16, 16, in_features // 2, 2)
    return blocks.permute(0, 2, 1, 3).contiguous()


def linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None, *, gelu: bool = False,
           residual: torch.Tensor | None = None) -> torch.Tensor:
    """x [..., in] bf16 @ the packed weight's transpose, plus bias (float32 or None) -> [..., out]
    bf16; then GELU (exact, erf) if gelu, or plus residual [..., out] (bf16) if given, each in
    float32 before the one rounding."""
    kernel = _kernel()
    assert kernel is not None, "the kernel is not available here (see available())"
    num_blocks, pairs = packed.shape[:2]
    in_features, out_features = 2 * pairs, 16 * num_blocks
    operands = Operands.of(x, in_features, out_features, gelu, residual)
    status = kernel(operands.rows.data_ptr(), packed.data_ptr(), 0 if bias is None else bias.data_ptr(),
                    operands.epilogue, operands.residual_ptr, operands.out.data_ptr(), operands.rows.shape[0],
                    in_features, out_features, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"bf16 linear kernel refused a {out_features}x{in_features} product")
    return operands.result(x)


@dataclass
class Operands:
    """What a linear kernel (this one, cpu_linear_int8's) reads and writes besides the weight:
    x's rows contiguous, the epilogue's code and residual, and the bf16 output."""

    rows: torch.Tensor
    epilogue: int
    residual_ptr: int
    residual: torch.Tensor | None  # kept alive for the call
    out: torch.Tensor

    @staticmethod
    def of(x: torch.Tensor, in_features: int, out_features: int, gelu: bool,
           residual: torch.Tensor | None) -> Operands:
        assert not (gelu and residual is not None), "one epilogue at a time"
        assert x.dtype == torch.bfloat16 and x.device.type == "cpu" and x.shape[-1] == in_features, x.shape
        rows = x.reshape(-1, in_features).contiguous()
        epilogue, residual_ptr = (_GELU if gelu else _NONE), 0
        if residual is not None:
            assert residual.dtype == torch.bfloat16 and residual.shape == (*x.shape[:-1], out_features), residual.shape
            residual = residual.reshape(-1, out_features).contiguous()
            epilogue, residual_ptr = _RESIDUAL, residual.data_ptr()
        out = torch.empty(rows.shape[0], out_features, dtype=torch.bfloat16)
        return Operands(rows, epilogue, residual_ptr, residual, out)

    def result(self, x: torch.Tensor) -> torch.Tensor:
        return self.out.view(*x.shape[:-1], self.out.shape[-1])

