"""The audio encoder compiled with torch.compile: the largest part of the CPU fast path, and
a fifth off the encoder on a GPU.

The encoder is most of the work on a CPU (every audio, however short, is a 30 s window).
Eager bf16 runs each op on its own, each writing its full output to memory. Inductor fuses
the GELUs, layer norms, residual adds and the attention's scaling and softmax into generated
C++ loops next to the GEMMs: on 2 AVX512-BF16 cores tiny.en's encoder drops from ~87 to ~65 ms
per 30 s window (benchmarks/cpu_fast_path.py). Its output is as close to float32 as eager
bf16's (relative error 1.2% against 1.4% on real speech).

One compiled graph serves every batch: audios go through it one at a time (a batch of 1500-row
matmuls is as efficient as one long one on a CPU, and a single input shape compiles once, at
start-up, in ~10 s). Freezing (weights baked in as constants, prepacked for oneDNN) measured
no faster here and would hold the weights twice, so it is off. Where the C kernels run
(AVX512-BF16), the runner no longer compiles under --compile auto: the eager encoder over the
linear kernel, with its GELU and residual adds in the kernel's epilogue, measured 6-10% quicker
(worker/model_runner.py).

On CUDA the whole batch goes through one graph whose batch dimension is dynamic (one
compilation for every batch size): a GPU needs the batch to fill it, and the fused elementwise
work (GELU, layer norms, residual adds) is what the eager encoder loses next to its GEMMs
(large-v3-turbo on an H100: 6.18 ms per 30 s audio eager, 4.83 compiled at batch 32, after
~40 s of compilation at start-up; docs/benchmarks.md).
"""

from __future__ import annotations

import logging
import os
import shutil
import time
from collections.abc import Callable

import torch

from asrserve.config import N_FRAMES
from asrserve.model import cpu_encoder_attention

logger = logging.getLogger(__name__)

Encoder = Callable[[torch.Tensor], torch.Tensor]


def should_compile(mode: str, device: torch.device, dtype: torch.dtype) -> bool:
    if mode == "off":
        return False
    if mode == "on":
        return True
    if device.type == "cuda":
        # 16-bit only: float32 is the exact mode, token for token against transformers, and
        # fusing changes its rounding.
        return dtype in (torch.bfloat16, torch.float16)
    compilers = (os.environ.get("CXX"), "g++", "c++", "clang++")
    has_compiler = any(shutil.which(name) for name in compilers if name)
    return device.type == "cpu" and dtype == torch.bfloat16 and has_compiler


def compiled_encoder(encoder: torch.nn.Module, n_mels: int, device: torch.device, dtype: torch.dtype,
                     mode: str) -> Encoder:
    """`encoder` itself, or a function that runs each audio of a batch through its compiled
    graph. The graph is compiled here, on a silent window, so that no request waits for it.
    With mode "auto" a failed compilation logs a warning and keeps the eager encoder."""
    if not should_compile(mode, device, dtype):
        return encoder
    if device.type == "cpu":
        cpu_encoder_attention.available()  # the C kernel built (or not) before the graph is traced
    compiled = torch.compile(encoder, dynamic=False)
    started = time.perf_counter()
    logger.info("compiling the audio encoder (--compile %s)", mode)
    batched = device.type == "cuda"
    try:
        with torch.inference_mode():
            # A batch of 2: dynamo specialises sizes 0 and 1, so a dynamic batch starts at 2.
            warm = torch.zeros(2 if batched else 1, n_mels, N_FRAMES, dtype=dtype, device=device)
            if batched:
                torch._dynamo.mark_dynamic(warm, 0)
            compiled(warm)
    except Exception as error:
        if mode == "on":
            raise
        logger.warning("compiling the encoder failed, running it eagerly: %s", str(error).splitlines()[0])
        torch._dynamo.reset()
        return encoder
    logger.info("compiled the audio encoder in %.1f s", time.perf_counter() - started)
    # One static shape: nothing compiles again. Inductor's compile-worker processes would sit
    # idle holding memory, and a SIGTERM to the process group would kill them under the pool
    # that must then be shut down at exit.
    from torch._inductor.async_compile import shutdown_compile_workers

    shutdown_compile_workers()

    def encode(mel: torch.Tensor) -> torch.Tensor:
        if batched:
            if mel.shape[0] == 1:  # below the dynamic range: pad to 2 rather than compile again
                return compiled(torch.cat([mel, mel]))[:1]
            torch._dynamo.mark_dynamic(mel, 0)
            return compiled(mel)
        return torch.cat([compiled(mel[i:i + 1]) for i in range(mel.shape[0])])

    return encode
