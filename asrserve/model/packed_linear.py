"""float32 linear layers on CPU through oneDNN, over weights packed once at start-up.

Two reasons, both measured on tiny.en (2 AVX2 cores, float32; docs/benchmarks.md):

1. **Batch invariance without padding.** MKL's sgemm (what nn.Linear and torch.mm call) picks
   its kernel, and so its rounding, by the row count: a row's logits come out with different
   bits alone, among 2-3 rows, 4-11 rows and 12 or more. The decoder therefore padded every
   step to at least 16 rows, and a lone request paid 16 rows of the 52k-token output
   projection (~18 of a ~35 ms step); even so log-probabilities moved by ~1e-6 between a
   request alone and in a batch. oneDNN's kernel over a packed weight gives a row the same
   bits whatever the row count and wherever it sits (1 to 300 rows checked, every Whisper
   shape), so steps run on their real rows and every log-probability is batch-invariant.
2. **Speed.** The output projection for 1-16 rows takes 6-10 ms instead of 10-25, and the
   encoder's 1500-row GEMMs are 10-30% quicker.

Row independence is a property of the kernel oneDNN picks for this CPU, not a documented
promise, so it is checked for every weight shape before packing; where it does not hold, the
decoder is left to MKL and the runner keeps padding (`batch_invariant_padding`). A packed
weight replaces its linear's (an opaque oneDNN tensor); the output projection's is a second
copy, since the token embedding still reads the original.
"""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

# Row counts compared with the rows of one 64-row product: alone, small batches, both sides of
# the kernel switches MKL has (2, 4, 12, 16) and odd sizes.
_CHECKED_ROW_COUNTS = (1, 2, 3, 4, 5, 8, 11, 12, 13, 16, 17, 33)
_CHECK_ROWS = 64


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """nn.Linear's forward over a oneDNN-packed float32 weight."""

    def __init__(self, packed: torch.Tensor, bias: torch.Tensor | None, in_features: int, out_features: int):
        super().__init__()
        self.packed = packed
        self.bias = bias
        self.in_features = in_features
        self.out_features = out_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return packed_linear(x, self.packed, self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for oneDNN"


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] packed for oneDNN, or None where this torch or CPU cannot."""
    if weight.device.type != "cpu" or weight.dtype != torch.float32 or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except (AttributeError, RuntimeError) as error:  # no such op in this build, or no kernel
        logger.info("oneDNN cannot pack a %s weight here: %s", tuple(weight.shape), error)
        return None


def rows_independent_of_batch(packed: torch.Tensor, bias: torch.Tensor | None, in_features: int) -> bool:
    """True when each row of a product comes out with the same bits whatever the row count
    and the row's position (compared bitwise with one 64-row product)."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(_CHECK_ROWS, in_features, generator=generator)
    with torch.inference_mode():
        full = packed_linear(x, packed, bias)
        for rows in _CHECKED_ROW_COUNTS:
            if not torch.equal(packed_linear(x[:rows], packed, bias), full[:rows]):
                return False
            last = _CHECK_ROWS - rows  # the same rows at the other end of the batch
            if not torch.equal(packed_linear(x[last:], packed, bias), full[last:]):
                return False
    return True


def _packed_weights(weights: dict[str, torch.Tensor]) -> dict[str, torch.Tensor] | None:
    """Every weight packed, or None when one cannot be or its rows depend on the batch."""
    packed: dict[str, torch.Tensor] = {}
    checked: dict[tuple[int, int], bool] = {}
    for name, weight in weights.items():
        packed_weight = pack_weight(weight)
        if packed_weight is None:
            return None
        shape = tuple(weight.shape)
        if shape not in checked:
            bias = torch.zeros(shape[0])  # the bias is added after the product: any will do
            checked[shape] = rows_independent_of_batch(packed_weight, bias, shape[1])
            if not checked[shape]:
                logger.warning("oneDNN's %s product depends on the batch on this CPU; keeping MKL", shape)
        if not checked[shape]:
            return None
        packed[name] = packed_weight
    return packed


def pack_linears(module: nn.Module) -> bool:
    """Swaps every nn.Linear of `module` for a PackedLinear, all or none: True when all are
    packed (or were already)."""
    linears = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    packed = _packed_weights({name: m.weight for name, m in linears})
    if packed is None:
        return False
    for name, linear in linears:
        bias = None if linear.bias is None else linear.bias.detach()
        module.set_submodule(name, PackedLinear(packed[name], bias, linear.in_features, linear.out_features))
    return True


def pack_whisper_linears(model: nn.Module, encoder: bool = True) -> bool:
    """Packs the decoder's linears and its output projection, and the encoder's linears when
    `encoder` (not when it is to be compiled: inductor takes packed weights only as frozen
    constants). Returns whether the decoder is packed: its steps then need no padding."""
    decoder = model.decoder
    if decoder.packed_output_weight is None:
        output = _packed_weights({"output": decoder.embed_tokens.weight})
        if output is None or not pack_linears(decoder):
            return False
        decoder.packed_output_weight = output["output"]
    if encoder:
        pack_linears(model.encoder)  # speed only: the encoder's rows are 1500 an audio either way
    return True
