"""The decoder's matrix products on CPU through oneDNN, over weights reordered once at load.

A decode step multiplies a few rows (one per running sequence) by the decoder's weights and by
the 52k-word output embedding. Two things about MKL's sgemm, torch's default there, cost a
lone request half of its step:
- it picks its kernel, and with it the order of the additions, by the number of rows, so a
  row's result depends on how many rows share the call. The engine pads every step to at least
  16 rows so that a request's tokens do not depend on its neighbours (batch invariance), and a
  lone request pays for 16 (the logits: ~11 ms of a ~20 ms step on 2 cores);
- it repacks the weight on every call.
oneDNN's inner product over a weight reordered once into its blocked layout computes each row
alike whatever the row count, needs no padding, and is about twice as fast at every row count
(logits of tiny.en on 2 cores: 3.5 ms for one row against MKL's 17 for a padded 16; 11 against
21 for 32 rows).

Row independence is a property of the kernels oneDNN picks on this CPU, not a promise, so
`prepack_decoder` checks it for every weight shape at load (random rows, one row at a time
against many at once) and keeps torch's own path, padded, where it does not hold.
"""

from __future__ import annotations

import torch
from torch import nn

# oneDNN's reorder takes the expected row count as a hint for the blocked layout; with 16 a
# row's result is the same for 1 to 2048 rows on the CPUs measured (1 gives one row its own
# kernel).
_ROWS_HINT = 16
_PROBE_ROW_COUNTS = (1, 2, 3, 5, 8, 16, 17, 33, 64, 130)


def available() -> bool:
    return torch.backends.mkldnn.is_available() and hasattr(torch.ops.mkldnn, "_reorder_linear_weight")


def prepack(weight: torch.Tensor) -> torch.Tensor:
    """[out, in] float32 weight -> oneDNN's blocked copy of it (an opaque tensor)."""
    return torch.ops.mkldnn._reorder_linear_weight(weight.detach().float().contiguous(), _ROWS_HINT)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    """x [..., in] @ weight.T + bias, over a weight from prepack."""
    rows = x.reshape(-1, x.shape[-1])
    out = torch.ops.mkldnn._linear_pointwise(rows.contiguous(), packed, bias, "none", [], "")
    return out.reshape(*x.shape[:-1], out.shape[-1])


def rows_are_independent(packed: torch.Tensor, bias: torch.Tensor | None, in_features: int) -> bool:
    """Whether every row's result is the same bit for bit whether it is computed alone, among a
    few rows or among many, and wherever it stands in the batch."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(max(_PROBE_ROW_COUNTS), in_features, generator=generator)
    reference = packed_linear(x, packed, bias)
    for count in _PROBE_ROW_COUNTS:
        if not torch.equal(packed_linear(x[:count], packed, bias), reference[:count]):
            return False
    shuffled = torch.randperm(x.shape[0], generator=generator)[:37]
    return torch.equal(packed_linear(x[shuffled], packed, bias), reference[shuffled])


class PrepackedLinear(nn.Module):
    """nn.Linear's forward over a oneDNN-packed copy of its weight (CPU, float32)."""

    def __init__(self, linear: nn.Linear):
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        self.packed = prepack(linear.weight)
        self.bias = None if linear.bias is None else linear.bias.detach().float().contiguous()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)


def prepack_decoder(decoder: nn.Module, output_weight: torch.Tensor) -> tuple[bool, torch.Tensor | None]:
    """Moves a CPU decoder's products onto oneDNN where they are row-independent on this CPU.

    Returns (unpadded, packed_output): unpadded is True when every linear of a float32 decoder
    now runs packed, so that decode steps need no padding for batch invariance; packed_output
    is the packed output embedding for the logits (fp32 also for 16-bit decoders), or None.
    Nothing changes where oneDNN is missing or a shape fails the check."""
    if not available() or output_weight.device.type != "cpu":
        return False, None
    checked: dict[tuple[int, int, bool], bool] = {}

    def independent(packed: torch.Tensor, bias: torch.Tensor | None, shape: tuple[int, int]) -> bool:
        key = (*shape, bias is not None)
        if key not in checked:  # the kernel depends on the shape, not on the values
            checked[key] = rows_are_independent(packed, bias, shape[1])
        return checked[key]

    packed_output = prepack(output_weight)
    if not independent(packed_output, None, tuple(output_weight.shape)):
        return False, None
    linears = [(parent, name, child) for parent in decoder.modules()
               for name, child in parent.named_children() if isinstance(child, nn.Linear)]
    if any(child.weight.dtype != torch.float32 for _, _, child in linears):
        return False, packed_output
    replacements = [(parent, name, PrepackedLinear(child)) for parent, name, child in linears]
    if not all(independent(new.packed, new.bias, (new.out_features, new.in_features))
               for _, _, new in replacements):
        return False, packed_output
    for parent, name, new in replacements:
        setattr(parent, name, new)
    return True, packed_output
