"""Linear layers on CPU through oneDNN, over weights packed once at start-up: float32, and
bfloat16 (where the decoder runs in bf16, its output projection is packed in bf16 too and the
logits that decide are recomputed exactly: rounded_logits.py).

Two reasons, both measured on tiny.en (2 AVX2 cores, float32; docs/benchmarks.md; and on 2
AVX512-BF16 cores in bf16, where a lone request's step paid 16 rows of MKL's float32 logits
product and of every bf16 linear):

1. **Batch invariance without padding.** MKL's sgemm (what nn.Linear and torch.mm call) picks
   its kernel, and so its rounding, by the row count: a row's logits come out with different
   bits alone, among 2-3 rows, 4-11 rows and 12 or more. The decoder therefore padded every
   step to at least 16 rows, and a lone request paid 16 rows of the 52k-token output
   projection (~18 of a ~35 ms step); even so log-probabilities moved by ~1e-6 between a
   request alone and in a batch. oneDNN's kernel over a packed weight gives a row the same
   bits whatever the row count and wherever it sits (1 to 300 rows checked, every Whisper
   shape), so steps run on their real rows and every log-probability is batch-invariant.
2. **Speed.** The output projection for 1-16 rows takes 6-10 ms instead of 10-25, and the
   encoder's 1500-row GEMMs are 10-30% quicker (the whole encoder ~5-10%). In bf16 (2 Zen 4
   cores) a lone request's decoder step went from 19-20 to 10-12 ms, 8 requests' from 31-34
   to 22-26 ms.

A lone row goes through as two (packed_linear): on AVX-512 CPUs oneDNN computes one row with a
matrix-vector kernel that sums in another order than its matrix kernel.

Row independence is a property of the kernel oneDNN picks for this CPU, not a documented
promise, so it is checked for every weight shape before packing, once per shape (kernel_checks
keeps each answer on disk for the next process on this machine and torch build)
(row counts up to 1500 against the same rows of a 3000-row product, up to 128 of a 256-row
one for the output projection, two of them at the far end of the batch; and the product
against F.linear).
Where it does not hold, the decoder is left to MKL and the runner keeps padding
(`batch_invariant_padding`). A packed weight replaces its linear's (an opaque oneDNN tensor);
the output projection's is a second copy, since the token embedding still reads the original
(float32: 80 MB more for tiny.en, 265 MB for large-v3; half that with 16-bit weights). A
packed model cannot be moved or cast afterwards (PackedLinear refuses), since its packed copies
would not follow.
"""

from __future__ import annotations

import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn

from asrserve.model import cpu_linear, cpu_linear_int8, kernel_checks

logger = logging.getLogger(__name__)

# Row counts whose products are compared bitwise with the same rows of one larger product:
# alone, small batches, both sides of the kernel switches MKL has (2, 4, 12, 16), odd sizes,
# long prefills and one audio's encoder rows (those below the larger product's count); a few
# of them also at the far end of the batch.
_CHECKED_ROW_COUNTS = (1, 2, 3, 4, 8, 12, 17, 33, 64, 128, 256, 1500)
_CHECKED_AT_THE_END = (1, 17)
# The larger product: two audios' encoder rows (and any prefill) for the layers; for the
# output projection, which gets one row per decoding sequence (plus one per request at
# <|startoftranscript|>), 256 rows, to keep its check at start-up short (each call reads the
# whole 52k-token matrix).
LAYER_CHECK_ROWS = 3000
OUTPUT_CHECK_ROWS = 256


def packed_linear(x: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    if x.numel() == x.shape[-1]:
        # One row goes through as two: on AVX-512 CPUs oneDNN computes a single row with a
        # matrix-vector kernel whose sums (for 1536 or more inputs) round otherwise than its
        # matrix kernel, so a lone request would get other bits than in a batch. Two rows cost
        # the same as one (the product reads the weight once either way).
        pair = x.reshape(1, -1).expand(2, -1).contiguous()
        out = torch.ops.mkldnn._linear_pointwise(pair, packed, bias, "none", [], "")
        return out[:1].reshape(*x.shape[:-1], out.shape[-1])
    return torch.ops.mkldnn._linear_pointwise(x, packed, bias, "none", [], "")


class PackedLinear(nn.Module):
    """nn.Linear's forward over a oneDNN-packed float32 or bf16 weight."""

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

    def _apply(self, fn, recurse=True):
        # .to(), .half(), .cuda() ... would leave the packed copy behind, unchanged: cast or
        # move a model before the runner packs it, never after.
        raise RuntimeError("a model with packed linears cannot be moved or cast; do it before packing")


class KernelLinear(PackedLinear):
    """nn.Linear's forward through cpu_linear's bf16 C kernel, over the weight packed for it
    (bias kept in float32, as the kernel adds it)."""

    def __init__(self, linear: nn.Linear):
        assert cpu_linear.takes(linear.weight), linear
        bias = None if linear.bias is None else linear.bias.detach().float()
        super().__init__(cpu_linear.pack(linear.weight), bias, linear.in_features, linear.out_features)

    def forward(self, x: torch.Tensor, *, gelu: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
        """x's product, then GELU or plus residual in the kernel's epilogue (linear_then)."""
        return cpu_linear.linear(x, self.packed, self.bias, gelu=gelu, residual=residual)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, packed for the C kernel"


class Int8KernelLinear(KernelLinear):
    """nn.Linear's forward through cpu_linear_int8's kernel: the weight in int8 per output, each
    input row quantized on the fly (the encoder's linears; see cpu_linear_int8 for what it costs
    in accuracy)."""

    def __init__(self, linear: nn.Linear):
        assert cpu_linear_int8.takes(linear.weight), linear
        weight = cpu_linear_int8.pack(linear.weight)
        bias = None if linear.bias is None else linear.bias.detach().float()
        PackedLinear.__init__(self, weight.packed, bias, linear.in_features, linear.out_features)
        self.weight_int8 = weight

    def forward(self, x: torch.Tensor, *, gelu: bool = False, residual: torch.Tensor | None = None) -> torch.Tensor:
        return cpu_linear_int8.linear(x, self.weight_int8, self.bias, gelu=gelu, residual=residual)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, int8 for the C kernel"


def linear_then(layer: nn.Module, x: torch.Tensor, *, gelu: bool = False,
                residual: torch.Tensor | None = None) -> torch.Tensor:
    """layer(x), then GELU or plus residual: in the C kernel's epilogue where layer is a
    KernelLinear (bf16 on CPU: one rounding, no extra pass over the output), as torch ops
    otherwise."""
    if isinstance(layer, KernelLinear):
        return layer(x, gelu=gelu, residual=residual)
    y = layer(x)
    if gelu:
        y = F.gelu(y)
    return y if residual is None else residual + y


# The dtypes packed, with how far the packed product may be from F.linear's (bf16: its
# accumulation is fp32 either way, the output rounded to bf16's 8 bits).
_TOLERANCES = {torch.float32: 1e-4, torch.bfloat16: 2e-2}
PACKED_DTYPES = tuple(_TOLERANCES)


def pack_weight(weight: torch.Tensor) -> torch.Tensor | None:
    """`weight` [out, in] packed for oneDNN, or None where this torch or CPU cannot."""
    if weight.device.type != "cpu" or weight.dtype not in _TOLERANCES or not torch.backends.mkldnn.is_available():
        return None
    try:
        return torch.ops.mkldnn._reorder_linear_weight(weight.detach(), None)
    except (AttributeError, RuntimeError) as error:  # no such op in this build, or no kernel
        logger.info("oneDNN cannot pack a %s weight here: %s", tuple(weight.shape), error)
        return None


def rows_independent_of_batch(weight: torch.Tensor, packed: torch.Tensor, bias: torch.Tensor | None,
                              largest_rows: int) -> bool:
    """True when the packed product is x @ weight.T and each of its rows comes out with the
    same bits whatever the row count (up to `largest_rows`) and the row's position."""
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(largest_rows, weight.shape[1], generator=generator).to(weight.dtype)
    tolerance = _TOLERANCES[weight.dtype]
    with torch.inference_mode():
        full = packed_linear(x, packed, bias)
        if full.dtype != weight.dtype or not torch.allclose(
                full[:64].float(), F.linear(x[:64], weight, bias).float(), rtol=tolerance, atol=tolerance):
            return False
        for rows in (count for count in _CHECKED_ROW_COUNTS if count < largest_rows):
            if not torch.equal(packed_linear(x[:rows], packed, bias), full[:rows]):
                return False
        for rows in _CHECKED_AT_THE_END:
            if not torch.equal(packed_linear(x[-rows:], packed, bias), full[-rows:]):
                return False
    return True


@functools.cache
def kernel_rows_independent(out_features: int, in_features: int, has_bias: bool, largest_rows: int,
                            dtype: torch.dtype = torch.float32) -> bool:
    """rows_independent_of_batch for oneDNN's kernel of this shape and dtype, over random
    weights: a property of the kernel this CPU gets, so each process checks a shape once (every
    engine of a test run, or a server's model and its second engine, shares the answer), and
    the answer is kept on disk for the processes after it (kernel_checks)."""
    arguments = (out_features, in_features, has_bias, largest_rows, str(dtype))
    answer = kernel_checks.remembered("rows-independent", _check_code(), arguments)
    if answer is None:
        answer = _check_kernel(out_features, in_features, has_bias, largest_rows, dtype)
        kernel_checks.remember("rows-independent", _check_code(), arguments, answer)
    return answer


@functools.cache
def _check_code() -> bytes:
    """This module's source: a change to the check (its row counts, its tolerance) is a new key."""
    return Path(__file__).read_bytes()


def _check_kernel(out_features: int, in_features: int, has_bias: bool, largest_rows: int,
                  dtype: torch.dtype) -> bool:
    generator = torch.Generator().manual_seed(0)
    weight = (torch.randn(out_features, in_features, generator=generator) * 0.05).to(dtype)
    bias = torch.randn(out_features, generator=generator).to(dtype) if has_bias else None
    packed = pack_weight(weight)
    return packed is not None and rows_independent_of_batch(weight, packed, bias, largest_rows)


def _packed_weights(weights: dict[str, tuple[torch.Tensor, torch.Tensor | None]],
                    largest_rows: int) -> dict[str, torch.Tensor] | None:
    """Every (weight, bias) packed in its own dtype, or None when one cannot be or its rows
    depend on the batch. Each shape's kernel is checked before anything is copied: the check
    makes a random weight of the shape, and a large model's output projection should not be
    held three times at once."""
    packed: dict[str, torch.Tensor] = {}
    for name, (weight, bias) in weights.items():
        out_features, in_features = weight.shape
        if not kernel_rows_independent(out_features, in_features, bias is not None, largest_rows, weight.dtype):
            logger.warning("oneDNN's packed %dx%d %s product fails the start-up check on this CPU (rows "
                           "depend on the batch, or it differs from F.linear); keeping MKL and padding",
                           out_features, in_features, weight.dtype)
            return None
        packed_weight = pack_weight(weight)
        if packed_weight is None:
            return None
        packed[name] = packed_weight
    return packed


def pack_linears(module: nn.Module) -> bool:
    """Swaps every nn.Linear of `module` for a PackedLinear, all or none: True when all are
    packed (or were already)."""
    linears = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    packed = _packed_weights({name: (m.weight, m.bias) for name, m in linears}, LAYER_CHECK_ROWS)
    if packed is None:
        return False
    for name, linear in linears:
        bias = None if linear.bias is None else linear.bias.detach()
        module.set_submodule(name, PackedLinear(packed[name], bias, linear.in_features, linear.out_features))
    return True


def pack_decoder_linears(model: nn.Module) -> bool:
    """Packs the decoder's linears and its output projection, all or none. Returns whether they
    are packed: the decoder's steps then need no padding. (The encoder's linears go on the C
    kernel with use_linear_kernel where it runs, or are packed with pack_linears where the
    encoder is not compiled: inductor takes packed weights only as frozen constants.)

    In bf16, where the C kernel runs (cpu_linear.py: as quick as oneDNN for many rows, 1.3-3x
    quicker for a step's few), the decoder's linears and its output projection go through it
    instead, all of them or none; its rows are batch-invariant by construction. Otherwise the
    output projection is packed for oneDNN in the model's dtype. With 16-bit weights either
    product is rounded and the logits that decide are recomputed exactly (rounded_logits.py)."""
    decoder = model.decoder
    if decoder.packed_output_weight is None:
        if use_linear_kernel(decoder):
            # The output projection through the kernel too, its vocabulary padded with zero
            # rows to a multiple of 16 (compute_logits drops their columns). Its product is
            # rounded to bf16 like oneDNN's (the same bits in every case measured) and
            # 0.3 ms quicker at 1-8 rows (tiny.en, 2 cores).
            weight = decoder.embed_tokens.weight.detach()
            padding = -weight.shape[0] % 16
            padded = torch.cat([weight, weight.new_zeros(padding, weight.shape[1])]) if padding else weight
            decoder.packed_output_weight = cpu_linear.pack(padded)
            decoder.output_kernel = True
            return True
        output = _packed_weights({"output": (decoder.embed_tokens.weight, None)}, OUTPUT_CHECK_ROWS)
        if output is None or not pack_linears(decoder):
            return False
        decoder.packed_output_weight = output["output"]
    return True


def use_linear_kernel(module: nn.Module, *, int8: bool = False) -> bool:
    """Swaps every nn.Linear of `module` for a KernelLinear (with int8, an Int8KernelLinear) if
    that kernel takes them all."""
    kernel, takes = (Int8KernelLinear, cpu_linear_int8.takes) if int8 else (KernelLinear, cpu_linear.takes)
    linears = [(name, m) for name, m in module.named_modules() if isinstance(m, nn.Linear)]
    if not linears or not all(takes(m.weight) for _, m in linears):
        return False
    for name, linear in linears:
        module.set_submodule(name, kernel(linear))
    return True

