"""How much an FP8 encoder could give on Hopper (measured, not built): large-v3-turbo's encoder
GEMMs at batch 32 (48,000 rows) in bf16 against FP8 e4m3 through `torch._scaled_mm`
(per-tensor scales, bf16 out), and the encoder's attention (SDPA) beside them.

    python benchmarks/gpu_fp8_probe.py [--batch 32]      # on a CUDA machine with compute capability 9.0
"""

from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F


def timed(fn, repeats: int = 20) -> float:
    """Milliseconds per call, after a warm-up, with CUDA events."""
    for _ in range(3):
        fn()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(repeats):
        fn()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=32)
    args = parser.parse_args()
    rows, width, heads = args.batch * 1500, 1280, 20
    shapes = {"qkv": (width, 3 * width), "out": (width, width), "fc1": (width, 4 * width), "fc2": (4 * width, width)}
    result = {"device": torch.cuda.get_device_name(), "rows": rows, "gemm_ms": {}}
    bf16_total = fp8_total = cast_total = 0.0
    for name, (k, n) in shapes.items():
        x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
        w = torch.randn(n, k, device="cuda", dtype=torch.bfloat16) / k**0.5
        bf16 = timed(lambda: x @ w.T)
        x8, w8 = x.to(torch.float8_e4m3fn), w.to(torch.float8_e4m3fn)
        one = torch.ones((), device="cuda")
        fp8 = timed(lambda: torch._scaled_mm(x8, w8.T, scale_a=one, scale_b=one, out_dtype=torch.bfloat16))
        # what a real FP8 path also pays each call unless a fused kernel does it: casting the input
        quantise = timed(lambda: x.to(torch.float8_e4m3fn))
        result["gemm_ms"][name] = {"bf16": round(bf16, 3), "fp8": round(fp8, 3), "quantise_input": round(quantise, 3),
                                   "bf16_tflops": round(2 * rows * k * n / bf16 / 1e9, 1),
                                   "fp8_tflops": round(2 * rows * k * n / fp8 / 1e9, 1)}
        bf16_total += bf16
        fp8_total += fp8
        cast_total += quantise
    q = torch.randn(args.batch, heads, 1500, width // heads, device="cuda", dtype=torch.bfloat16)
    attention = timed(lambda: F.scaled_dot_product_attention(q, q, q))
    result["attention_ms"] = round(attention, 3)
    bf16_layer, fused, unfused = bf16_total + attention, fp8_total + attention, fp8_total + cast_total + attention
    result["layer_ms"] = {"bf16": round(bf16_layer, 3), "fp8_casts_unfused": round(unfused, 3),
                          "fp8_casts_fused": round(fused, 3)}
    result["layer_speedup"] = {"casts_unfused": round(bf16_layer / unfused, 2),
                               "casts_fused_bound": round(bf16_layer / fused, 2)}
    print(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
