"""The audio encoder compiled with torch.compile for CPUs: the largest part of the CPU fast path.

The encoder is most of the work on a CPU (every audio, however short, is a 30 s window).
Eager bf16 runs each op on its own and MKL's bf16 GEMM for the linears. Inductor with freezing
prepacks the weights for oneDNN's bf16 kernels, fuses bias + GELU into the linears, and fuses
the layer norms, residual adds and the attention's softmax into generated C++ loops: on 2
AVX512-BF16 cores tiny.en's encoder drops from ~90 to ~63 ms per audio (docs/benchmarks.md).

One compiled graph serves every batch: audios go through it one at a time (a batch of 1500-row
matmuls is as efficient as one long one on a CPU, and a single input shape compiles once, at
start-up, in ~10 s). Freezing bakes the weights into the graph as constants, so the encoder's
weights are held twice; on GPUs the eager batched encoder stays.
"""

from __future__ import annotations

import logging
import os
import shutil
from collections.abc import Callable

import torch

from asrserve.config import N_FRAMES

logger = logging.getLogger(__name__)

Encoder = Callable[[torch.Tensor], torch.Tensor]


def should_compile(mode: str, device: torch.device, dtype: torch.dtype) -> bool:
    if mode == "off":
        return False
    if mode == "on":
        return True
    has_compiler = any(shutil.which(name) for name in (os.environ.get("CXX", "g++"), "g++", "c++", "clang++"))
    return device.type == "cpu" and dtype == torch.bfloat16 and has_compiler


def compiled_encoder(encoder: torch.nn.Module, n_mels: int, device: torch.device, dtype: torch.dtype,
                     mode: str) -> Encoder:
    """`encoder` itself, or a function that runs each audio of a batch through its compiled
    graph. The graph is compiled here, on a silent window, so that no request waits for it.
    With mode "auto" a failed compilation logs a warning and keeps the eager encoder."""
    if not should_compile(mode, device, dtype):
        return encoder
    compiled = torch.compile(encoder, dynamic=False, options={"freezing": True})
    try:
        with torch.inference_mode():
            compiled(torch.zeros(1, n_mels, N_FRAMES, dtype=dtype, device=device))
    except Exception as error:
        if mode == "on":
            raise
        logger.warning("compiling the encoder failed, running it eagerly: %s", str(error).splitlines()[0])
        torch._dynamo.reset()
        return encoder

    def encode(mel: torch.Tensor) -> torch.Tensor:
        return torch.cat([compiled(mel[i:i + 1]) for i in range(mel.shape[0])])

    return encode
