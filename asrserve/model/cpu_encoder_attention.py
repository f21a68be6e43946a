"""The encoder's self-attention on CPU in bfloat16, as a small C kernel (csrc/) registered as a
torch custom op, so that the compiled encoder calls it as one opaque step.

The encoder is most of a CPU's work (every audio, however short, is a 30 s window), and its
attention, 1500 positions over 1500 per head, a third of that. torch runs it one head at a time
(whisper.attention_by_head): a bf16 GEMM writes the head's 1500 x 1500 scores (4.5 MB, more
than a core's 1 MB L2) rounded to bf16, a fused softmax reads and writes them again, and a
second GEMM reads them. The kernel takes six queries at a time: their scores against every key
in float32 stay in cache (6 x 1504), then the softmax and the product with the values, with the
keys and values packed once per head for the dot-product instruction (bf16_tiles.h). Scores
and softmax are float32 (the torch path rounds the scores to bf16 first); the weights are
rounded to bf16 for the second product, as torch's are.

Built and loaded by cpu_kernels.py; where it cannot run (no AVX512-BF16, no C compiler,
ASRSERVE_CPU_KERNELS=0) attention_by_head serves.
"""

from __future__ import annotations

import ctypes

import torch

from asrserve.model import cpu_kernels


def _kernel():
    return cpu_kernels.load("encoder_attention_bf16.c", "asrserve_encoder_attention_bf16",
                            (ctypes.c_void_p,) * 2 + (ctypes.c_int64,) * 4 + (ctypes.c_int,))


_available: bool | None = None


def available() -> bool:
    """Kept in a plain global once known: torch.compile reads it as a constant (it would trace
    into the build and the cache otherwise). compiled_encoder asks before compiling."""
    global _available
    if _available is None:
        _available = _kernel() is not None
    return _available


def takes(qkv: torch.Tensor) -> bool:
    """Whether the kernel takes this [batch, length, 3, heads, head_dim] projection."""
    return (qkv.dtype == torch.bfloat16 and qkv.device.type == "cpu" and qkv.shape[-1] % 16 == 0
            and available())


def encoder_attention(qkv: torch.Tensor) -> torch.Tensor:
    """Full (unmasked) attention of each audio's positions: [B, L, 3, H, D] bf16 -> [B, L, H, D].
    The custom op inside a compiled encoder; the kernel directly in eager mode, where the op's
    dispatch would import torch._dynamo on the first call (1.2 s of a CLI run)."""
    return encoder_attention_op(qkv) if torch.compiler.is_compiling() else _attend(qkv)


@torch.library.custom_op("asrserve::encoder_attention_bf16", mutates_args=())
def encoder_attention_op(qkv: torch.Tensor) -> torch.Tensor:
    return _attend(qkv)


def _attend(qkv: torch.Tensor) -> torch.Tensor:
    kernel = _kernel()
    assert kernel is not None, "the kernel is not available here (see available())"
    batch, length, three, heads, head_dim = qkv.shape
    assert three == 3 and qkv.dtype == torch.bfloat16 and qkv.device.type == "cpu"
    qkv = qkv.contiguous()
    out = torch.empty(batch, length, heads, head_dim, dtype=qkv.dtype)
    status = kernel(qkv.data_ptr(), out.data_ptr(), batch, length, heads, head_dim, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"bf16 encoder attention kernel refused head_dim {head_dim} or ran out of memory")
    return out


@encoder_attention_op.register_fake
def _(qkv: torch.Tensor) -> torch.Tensor:
    batch, length, _, heads, head_dim = qkv.shape
    return qkv.new_empty(batch, length, heads, head_dim)
