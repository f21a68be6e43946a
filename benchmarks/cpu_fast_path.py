"""What each lever of the CPU fast path buys, measured on this machine with tiny.en:

    python benchmarks/cpu_fast_path.py [--batch 8] [--requests 8,32]

Encoder: milliseconds per 30 s window for float32 (SDPA), bfloat16 with torch's SDPA,
bfloat16 with our one-head-at-a-time attention (the eager fast path), and the compiled
encoder (one audio at a time, as the engine runs it). Decoder: one layer's cross-attention
over 1500 encoder positions for N decoding requests, torch's SDPA against our head-major
matmuls (copies included), in bfloat16.
"""

from __future__ import annotations

import argparse
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asrserve.config import ModelConfig
from asrserve.model import whisper
from asrserve.model.attention import GatherBuffers, _attention_head_major
from asrserve.model.encoder_compile import compiled_encoder
from asrserve.model.loader import load_model


def per_call_ms(fn, repeats: int) -> float:
    with torch.inference_mode():
        fn()
        fn()
        start = time.perf_counter()
        for _ in range(repeats):
            fn()
        return (time.perf_counter() - start) / repeats * 1000


def sdpa_by_qkv(qkv: torch.Tensor) -> torch.Tensor:
    """torch's SDPA on the same [B, L, 3, H, D] input: what the bf16 encoder ran before."""
    q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
    return F.scaled_dot_product_attention(q, k, v).transpose(1, 2)


def encoder_rows(batch: int, repeats: int) -> list[tuple[str, float]]:
    cpu = torch.device("cpu")
    rows = []
    fp32 = load_model(ModelConfig(), cpu, torch.float32).model.encoder
    mel = torch.randn(batch, 80, 3000, generator=torch.Generator().manual_seed(0))
    rows.append(("float32, SDPA", per_call_ms(lambda: fp32(mel), repeats) / batch))
    bf16 = load_model(ModelConfig(), cpu, torch.bfloat16).model.encoder
    mel16 = mel.bfloat16()
    fast_path = whisper.attention_by_head
    whisper.attention_by_head = sdpa_by_qkv
    try:
        rows.append(("bfloat16, SDPA", per_call_ms(lambda: bf16(mel16), repeats) / batch))
    finally:
        whisper.attention_by_head = fast_path
    rows.append(("bfloat16, attention one head at a time", per_call_ms(lambda: bf16(mel16), repeats) / batch))
    encode = compiled_encoder(bf16, 80, cpu, torch.bfloat16, "on")
    rows.append(("bfloat16, compiled (the default)", per_call_ms(lambda: encode(mel16), repeats) / batch))
    return rows


def cross_attention_rows(requests: list[int], repeats: int) -> list[tuple[str, float]]:
    rows = []
    generator = torch.Generator().manual_seed(0)
    for n in requests:
        keys, values = torch.randn(2, n, 1500, 6, 64, generator=generator).bfloat16().unbind(0)
        queries = torch.randn(n, 1, 6, 64, generator=generator).bfloat16()
        buffers = GatherBuffers()
        sdpa = lambda: F.scaled_dot_product_attention(  # noqa: E731
            queries.transpose(1, 2), keys.transpose(1, 2), values.transpose(1, 2))
        rows.append((f"{n} requests, SDPA", per_call_ms(sdpa, repeats)))
        ours = lambda: _attention_head_major(queries, keys, values, None, buffers)  # noqa: E731
        rows.append((f"{n} requests, head-major matmuls", per_call_ms(ours, repeats)))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="audios per encoder call")
    parser.add_argument("--requests", default="8,32", help="decoding requests for the cross-attention rows")
    parser.add_argument("--repeats", type=int, default=5)
    args = parser.parse_args()
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    print(f"\nencoder, batch of {args.batch}: ms per 30 s window")
    for name, ms in encoder_rows(args.batch, args.repeats):
        print(f"  {name:<44}{ms:>8.1f}")
    print("\ndecoder cross-attention, one layer, bfloat16: ms per step")
    for name, ms in cross_attention_rows([int(n) for n in args.requests.split(",")], 4 * args.repeats):
        print(f"  {name:<44}{ms:>8.2f}")


if __name__ == "__main__":
    main()
