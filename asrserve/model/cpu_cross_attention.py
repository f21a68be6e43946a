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

Several rows over one slot (a fallback's samples) are a small GEMM, which torch's matmuls do
better beyond a few rows: those runs stay on the torch path (MAX_ROWS_PER_SLOT).

It is built at first use (in under a second) with the machine's C compiler, the one
torch.compile needs too, into a cache directory (cache_dir()), and loaded with ctypes; the OpenMP runtime it links is the one torch has
already loaded. Without AVX512-BF16, without a compiler, or if the build fails, the torch path
serves (a warning says why). ASRSERVE_CPU_KERNELS=0 turns it off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).parent / "csrc" / "cross_attention_bf16.c"
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fopenmp", "-shared", "-fPIC")
MAX_ROWS_PER_SLOT = 4  # rows decoding over one slot; more go through torch's matmuls


def cache_dir() -> Path:
    """$XDG_CACHE_HOME/asrserve/kernels (~/.cache by default), or a temporary directory where that
    cannot be written: a build takes under a second, so keeping it is a convenience only."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "asrserve" / "kernels"
    try:
        base.mkdir(parents=True, exist_ok=True)
        if os.access(base, os.W_OK):
            return base
    except OSError:
        pass
    return Path(tempfile.gettempdir()) / f"asrserve-kernels-{os.getuid()}"


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    return None


@functools.cache
def _kernel():
    if os.environ.get("ASRSERVE_CPU_KERNELS", "1") == "0":
        return None
    if not torch.cpu._is_avx512_bf16_supported():
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: bf16 cross-attention runs on the slower torch path")
        return None
    source = SOURCE.read_bytes()
    key = hashlib.sha256(source + " ".join((compiler, *FLAGS)).encode()).hexdigest()[:16]
    library = cache_dir() / f"cross_attention_bf16-{key}.so"
    try:
        if not library.exists():
            library.parent.mkdir(parents=True, exist_ok=True)
            # Built under a temporary name and renamed: processes starting together never load
            # a half-written library.
            handle, partial = tempfile.mkstemp(dir=library.parent, suffix=".so.partial")
            os.close(handle)
            try:
                subprocess.run([compiler, *FLAGS, "-o", partial, str(SOURCE)], check=True, capture_output=True,
                               timeout=120)
                os.replace(partial, library)
            finally:
                if os.path.exists(partial):
                    os.unlink(partial)
        function = ctypes.CDLL(str(library)).asrserve_cross_attention_bf16
    except (OSError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        logger.warning("building the bf16 cross-attention kernel failed, using the torch path: %s %s", error,
                       detail.decode(errors="replace")[-500:])
        return None
    function.restype = ctypes.c_int
    function.argtypes = [ctypes.c_void_p] * 4 + [ctypes.c_int64] * 6
    return function


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
    queries = queries.contiguous()
    out = torch.empty_like(queries)
    status = kernel(queries.data_ptr(), keys.data_ptr(), values.data_ptr(), out.data_ptr(), num_slots, rows, heads,
                    keys.shape[2], cross_len, head_dim)
    if status != 0:
        raise RuntimeError(f"bf16 cross-attention kernel failed (head_dim {head_dim}, cross_len {cross_len})")
    return out
