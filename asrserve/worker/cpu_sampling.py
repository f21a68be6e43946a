"""The sampler's last pass on CPU as one C kernel (model/csrc/sample_rows.c): each row's
log-normaliser, its token (greedy, or drawn by inverse CDF with the row's uniform number) and
that token's log-probability, over float32 logits [rows, 52k].

In torch that is a logsumexp and an argmax over every row, then for the rows sampled at a
temperature a softmax, a cumulative sum and a search: five passes over [rows, vocab] and its
temporaries, ~6.5 ms of a ~33 ms decode step at ~50 rows (a fallback's samples; torch
profiler, the mixed clips). The kernel reads a row two or three times, in cache, and writes
nothing but the results. The choice is the same (the first maximum; the first token whose
running sum of weights passes the drawn point, a masked token never); log-probabilities agree
with torch's to float32 rounding of the sums. Rows are computed alike whatever their number,
so a request's results do not depend on its neighbours.

Used on CPU where the kernels can run (model/cpu_kernels.py); elsewhere sampler.py's torch
path serves.
"""

from __future__ import annotations

import ctypes

import torch

from asrserve.model import cpu_kernels


def _kernel():
    return cpu_kernels.load("sample_rows.c", "asrserve_sample_rows",
                            (ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64) + (ctypes.c_void_p,) * 4
                            + (ctypes.c_int,))


def available() -> bool:
    return _kernel() is not None


def sample_rows(logits: torch.Tensor, temperatures: list[float], uniforms: list[float]) -> tuple[list[int], list[float]]:
    """logits [rows, vocab] float32 on CPU (rows may be strided); per row a temperature (0:
    greedy) and a uniform number in [0, 1) (read only above 0) -> (token ids, log-probabilities
    of those tokens under softmax(logits))."""
    rows, vocab = logits.shape
    assert len(temperatures) == len(uniforms) == rows
    assert logits.dtype == torch.float32 and logits.device.type == "cpu", (logits.dtype, logits.device)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    temperature = torch.tensor(temperatures, dtype=torch.float32)
    uniform = torch.tensor(uniforms, dtype=torch.float32)
    tokens = torch.empty(rows, dtype=torch.int64)
    logprobs = torch.empty(rows, dtype=torch.float32)
    status = _kernel()(logits.data_ptr(), rows, vocab, logits.stride(0), temperature.data_ptr(), uniform.data_ptr(),
                       tokens.data_ptr(), logprobs.data_ptr(), torch.get_num_threads())
    if status != 0:
        raise RuntimeError("the sampling kernel failed")
    return tokens.tolist(), logprobs.tolist()
