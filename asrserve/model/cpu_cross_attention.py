"""Cross-attention of a decode step on CPU in bfloat16, as a small C kernel (csrc/).

A decode step's cross-attention reads every request's 1500 encoder keys and values in every
layer (tiny.en: 9.2 MB a request and step), for one query row each: memory-bound work. torch
runs it as two batched matmuls with a softmax between (attention._attention_16bit_cpu), ~22
GB/s on 2 AVX512-BF16 cores where a plain read of the same memory runs at ~45, and rounds the
scores to bf16 on the way. The kernel reads each (request, head)'s keys and values once, in
order, straight from the slot, and keeps scores, softmax and sums in float32: 33 requests' one
layer in ~2.0 ms against ~3.5, 8 requests in 0.23 against 1.0, one in 0.04 against 0.17
(`python benchmarks/cpu_fast_path.py --only cross-attention`), and ~3x closer to float32. Each
(request, head) is computed on its own, so a request's output does not depend on its
neighbours in the step.

Several rows over one slot (a request and its fallback samples) share one read of it, up to 16
rows at a time. Every row is computed the same way whatever the number of rows and slots in
the call, so a sample's output does not depend on how many of its siblings are decoding: with
several rows, sixteen keys' dot products are summed across lanes together in the order one
key's are (reduce16), and four rows' weighted sums of the values stay in registers. A request's
25 fallback samples take 0.34 ms a layer against 0.52 before those two and 0.48 for torch's
matmuls (`python benchmarks/cpu_fast_path.py --only cross-attention`, tiny.en, 2 Zen 4 cores).

Built and loaded by cpu_kernels.py; where it cannot run (no AVX512-BF16, no C compiler,
ASRSERVE_CPU_KERNELS=0) the torch path serves.
"""

from __future__ import annotations

import ctypes

import torch

from asrserve.model import cpu_kernels


def _kernel():
    return cpu_kernels.load("cross_attention_bf16.c", "asrserve_cross_attention_bf16",
                            (ctypes.c_void_p,) * 4 + (ctypes.c_int64,) * 6 + (ctypes.c_int,))


def available() -> bool:
    return _kernel() is not None


def cross_attention(queries: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, cross_len: int) -> torch.Tensor:
    """queries [slots, rows, heads, head_dim] (scaled by head_dim ** -0.5) over the first
    cross_len positions of keys and values [slots, heads, slot_tokens, head_dim], all bf16 on
    CPU -> [slots, rows, heads, head_dim]. keys and values are read in place: they must be
    contiguous (a run of neighbouring slots is)."""
    kernel = _kernel()
    assert kernel is not None, "the kernel is not available here (see available())"
    num_slots, rows, heads, head_dim = queries.shape
    assert keys.shape == values.shape and keys.shape[:2] == (num_slots, heads) and keys.shape[3] == head_dim
    for tensor in (queries, keys, values):
        assert tensor.dtype == torch.bfloat16 and tensor.device.type == "cpu" and tensor.is_contiguous()
    out = torch.empty_like(queries)
    status = kernel(queries.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), num_slots, rows, heads,
                    keys.shape[2], cross_len, head_dim, torch.get_num_threads())
    if status != 0:
        raise RuntimeError(f"bf16 cross-attention kernel failed (head_dim {head_dim}, cross_len {cross_len})")
    return out
