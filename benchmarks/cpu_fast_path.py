"""What each lever of the CPU fast path buys, measured on this machine with tiny.en:

    python benchmarks/cpu_fast_path.py [--batch 8] [--requests 8,32] [--only decode-step] [--decode-dtype bfloat16]
    python benchmarks/cpu_fast_path.py --only encoder-float32   # quick: no bf16 rows

Encoder: milliseconds per 30 s window for float32 (SDPA) with MKL's linears and with oneDNN's
packed ones (the engine's float32 path), in turns; bfloat16 with torch's SDPA,
bfloat16 with our one-head-at-a-time attention (the eager path without the C kernel), where
the C kernel runs the compiled encoder without it, the eager encoder with it, and the compiled
encoder (one audio at a time, as the engine runs it). Decoder: one layer's cross-attention
over 1500 encoder positions for N decoding requests in their slots, in bfloat16: torch's SDPA,
two batched bf16 matmuls (the torch path) and the C kernel (model/cpu_cross_attention.py, where
this CPU has AVX512-BF16 and a compiler). Sampler: the last pass over the logits (argmax,
log-normaliser, inverse-CDF draws) in torch and as the C kernel. Decode step: the whole decoder forward and the logits
for N requests decoding their 45th token, in float32 (the dtype of CPUs without native bf16;
--decode-dtype bfloat16 for those with it), as the engine runs it (float32: linears through
oneDNN over packed weights; bf16 where the C kernels run: linears, self- and cross-attention
through them; steps unpadded) with the requests' cross slots side by side and scattered
(every other slot: one attention call per request), and with MKL's linears and steps padded to
16 rows as it ran before; in bfloat16 also with the torch path's cross-attention, its
self-attention, or oneDNN's linears in place of each C kernel. Run in a tree
from before cross-attention was read in place, the engine path is that tree's.
"""

from __future__ import annotations

import argparse
import inspect
import statistics
import sys
import time
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np

from asrserve.config import ModelConfig
from asrserve.engine.block_manager import BlockManager
from asrserve.engine.request import Request, SamplingParams
from asrserve.model import whisper
from asrserve.model import attention, cpu_cross_attention, cpu_encoder_attention, cpu_linear, cpu_self_attention
from asrserve.model.attention import _attention_16bit_cpu
from asrserve.model.encoder_compile import compiled_encoder
from asrserve.model.loader import load_model
from asrserve.model.packed_linear import pack_decoder_linears, pack_linears, pack_weight, use_linear_kernel
from asrserve.worker import cpu_sampling
from asrserve.worker.input_batch import DecoderInputBuilder
from asrserve.worker.sampler import batch_invariant_logsumexp, sample_by_inverse_cdf


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


def float32_encoder_rows(batch: int, repeats: int, rounds: int = 3) -> list[tuple[str, str]]:
    """The float32 encoder with MKL's linears and with oneDNN's packed ones, taking turns
    `rounds` times (this machine drifts): each row is the range over the rounds."""
    cpu = torch.device("cpu")
    mel = torch.randn(batch, 80, 3000, generator=torch.Generator().manual_seed(0))
    variants = {"float32, SDPA, MKL linears": load_model(ModelConfig(), cpu, torch.float32).model.encoder}
    packed = load_model(ModelConfig(), cpu, torch.float32).model
    if pack_linears(packed.encoder):
        variants["float32, SDPA, oneDNN packed linears (the default)"] = packed.encoder
    timings: dict[str, list[float]] = {name: [] for name in variants}
    for _ in range(rounds):
        for name, encoder in variants.items():
            timings[name].append(per_call_ms(lambda: encoder(mel), repeats) / batch)
    return [(name, f"{min(values):.1f}-{max(values):.1f}") for name, values in timings.items()]


def encoder_rows(batch: int, repeats: int) -> list[tuple[str, float]]:
    cpu = torch.device("cpu")
    rows = []
    mel = torch.randn(batch, 80, 3000, generator=torch.Generator().manual_seed(0))
    bf16 = load_model(ModelConfig(), cpu, torch.bfloat16).model.encoder
    mel16 = mel.bfloat16()
    kernel = cpu_encoder_attention.available()
    cpu_encoder_attention._available = False  # the torch paths first
    try:
        fast_path = whisper.attention_by_head
        whisper.attention_by_head = sdpa_by_qkv
        try:
            rows.append(("bfloat16, SDPA", per_call_ms(lambda: bf16(mel16), repeats) / batch))
        finally:
            whisper.attention_by_head = fast_path
        rows.append(("bfloat16, attention one head at a time", per_call_ms(lambda: bf16(mel16), repeats) / batch))
        if kernel:
            encode = compiled_encoder(bf16, 80, cpu, torch.bfloat16, "on")
            rows.append(("bfloat16, compiled, torch attention", per_call_ms(lambda: encode(mel16), repeats) / batch))
    finally:
        cpu_encoder_attention._available = kernel
    if kernel:
        rows.append(("bfloat16, attention as the C kernel", per_call_ms(lambda: bf16(mel16), repeats) / batch))
    encode = compiled_encoder(bf16, 80, cpu, torch.bfloat16, "on")
    rows.append(("bfloat16, compiled (--compile on)", per_call_ms(lambda: encode(mel16), repeats) / batch))
    on_kernels = load_model(ModelConfig(), cpu, torch.bfloat16).model.encoder
    if kernel and use_linear_kernel(on_kernels):
        rows.append(("bfloat16, linears with GELU and residual epilogues and attention as C kernels "
                     "(--encoder-quantization none)", per_call_ms(lambda: on_kernels(mel16), repeats) / batch))
    int8 = load_model(ModelConfig(), cpu, torch.bfloat16).model.encoder
    if kernel and use_linear_kernel(int8, int8=True):
        rows.append(("the same with the linears in int8 (the default)", per_call_ms(lambda: int8(mel16), repeats) / batch))
    return rows


def cross_attention_rows(requests: list[int], repeats: int) -> list[tuple[str, float]]:
    """One layer's cross-attention for n requests decoding one row each over their slots
    (head-major, 1504 positions of which 1500 are read), as the engine lays them out: torch's
    SDPA, the torch path (two batched bf16 matmuls over whole slots, masked) and the C kernel."""
    rows = []
    generator = torch.Generator().manual_seed(0)
    slot_tokens, cross_len = 1504, 1500
    mask = torch.arange(slot_tokens) < cross_len
    for n in requests:
        keys, values = torch.randn(2, n, 6, slot_tokens, 64, generator=generator).bfloat16().unbind(0)
        queries = (torch.randn(n, 1, 6, 64, generator=generator) * 64**-0.5).bfloat16()
        sdpa = lambda: F.scaled_dot_product_attention(  # noqa: E731
            queries.transpose(1, 2), keys[:, :, :cross_len], values[:, :, :cross_len])
        rows.append((f"{n} requests, SDPA", per_call_ms(sdpa, repeats)))
        matmuls = lambda: _attention_16bit_cpu(queries.transpose(1, 2), keys, values, mask)  # noqa: E731
        rows.append((f"{n} requests, bf16 matmuls (torch path)", per_call_ms(matmuls, repeats)))
        if cpu_cross_attention.available():
            kernel = lambda: cpu_cross_attention.cross_attention(queries, keys, values, cross_len)  # noqa: E731
            rows.append((f"{n} requests, C kernel (engine path)", per_call_ms(kernel, repeats)))
    # A request in fallback: its 25 samples (5 temperatures x best_of 5) over its one slot.
    keys, values = torch.randn(2, 1, 6, slot_tokens, 64, generator=generator).bfloat16().unbind(0)
    queries = (torch.randn(1, 25, 6, 64, generator=generator) * 64**-0.5).bfloat16()
    matmuls = lambda: _attention_16bit_cpu(queries.transpose(1, 2), keys, values, mask)  # noqa: E731
    rows.append(("1 request's 25 fallback samples, bf16 matmuls (torch path)", per_call_ms(matmuls, repeats)))
    if cpu_cross_attention.available():
        kernel = lambda: cpu_cross_attention.cross_attention(queries, keys, values, cross_len)  # noqa: E731
        rows.append(("1 request's 25 fallback samples, C kernel (engine path)", per_call_ms(kernel, repeats)))
    return rows


def sampler_rows(requests: list[int], repeats: int) -> list[tuple[str, float]]:
    """The sampler's last pass over n rows of float32 logits [n, 51865] (after the rules): every
    row's argmax and log-normaliser and, for the rows sampled at a temperature, an inverse-CDF
    draw; torch (sampler.py) against the C kernel (worker/cpu_sampling.py). Greedy rows alone,
    and every row sampled (a fallback's samples)."""
    rows = []
    for n in requests:
        logits = 4 * torch.randn(n, 51865, generator=torch.Generator().manual_seed(n))
        for label, temperature in (("greedy", 0.0), ("sampled at 0.6", 0.6)):
            generators = [torch.Generator().manual_seed(i) for i in range(n)]

            def torch_path(temperature=temperature, generators=generators):
                normalizers = batch_invariant_logsumexp(logits)
                tokens = logits.argmax(-1)
                if temperature:
                    tokens = sample_by_inverse_cdf(logits.clone(), torch.full((n,), temperature), generators)
                return (logits.gather(1, tokens[:, None]).squeeze(1) - normalizers).tolist()

            rows.append((f"{n} rows {label}, torch", per_call_ms(torch_path, repeats)))
            if cpu_sampling.available():
                uniforms = torch.rand(n).tolist()
                kernel = lambda t=temperature, u=uniforms: cpu_sampling.sample_rows(logits, [t] * n, u)  # noqa: E731
                rows.append((f"{n} rows {label}, C kernel", per_call_ms(kernel, repeats)))
    return rows


def decode_step_rows(requests: list[int], repeats: int, rounds: int = 5,
                     dtype: torch.dtype = torch.float32) -> list[tuple[str, float]]:
    """The engine's decoder forward and logits for n requests decoding their 45th token, with
    their cross slots side by side (one attention call per layer) and scattered (every other
    slot: one call per request), and the gathered reference. The variants take turns, `rounds`
    times, and each row is the median round: this machine's memory bandwidth drifts.

    Run in an older tree (no cross_in_place), the engine path is that tree's: how "before" in
    docs/benchmarks.md was measured."""
    cpu = torch.device("cpu")
    loaded = load_model(ModelConfig(), cpu, dtype)
    decoder, dims = loaded.model.decoder, loaded.model.dims
    # The engine's CPU path packs the linears (bf16: for the C kernel where it runs) and runs
    # steps unpadded; the MKL model with steps padded to 16 rows is how it ran before
    # (packed_linear.py).
    mkl_decoder = load_model(ModelConfig(), cpu, dtype).model.decoder
    packed = pack_decoder_linears(loaded.model)
    kernels = dtype == torch.bfloat16 and cpu_cross_attention.available()
    onednn_decoder = None
    if kernels and cpu_linear.available():  # the bf16 linears and logits through oneDNN, as before
        onednn_decoder = load_model(ModelConfig(), cpu, dtype).model.decoder
        pack_linears(onednn_decoder)
        onednn_decoder.packed_output_weight = pack_weight(onednn_decoder.embed_tokens.weight)
    self_kernel = kernels and cpu_self_attention.available()
    special = loaded.tokenizer.special
    prompt = [special.sot, special.no_timestamps, *range(400, 443)]
    has_reference = "cross_in_place" in inspect.signature(DecoderInputBuilder).parameters
    block_size, steps = 16, {}
    for n in requests:
        for layout, spacing in (("slots side by side", 1), ("slots scattered", 2)):
            blocks = BlockManager(spacing * n * (94 + 3) + 8, block_size, dims.n_audio_ctx)
            kv_cache = torch.randn(dims.n_text_layer, 2, blocks.num_blocks, block_size, dims.n_text_head,
                                   dims.head_dim, generator=torch.Generator().manual_seed(0)).to(dtype)
            admitted = []
            for i in range(spacing * n):
                request = Request(f"r{i}", np.zeros(16000, np.float32), prompt, SamplingParams(), 100)
                request.num_computed_tokens, request.no_speech_prob = len(prompt) - 1, 0.0
                blocks.admit(request)
                admitted.append(request)
            for request in admitted[1::spacing] if spacing > 1 else ():
                blocks.free(request)
            batch = admitted[::spacing]
            padding = 0 if packed else 8
            engine = {"cpu_self_kernel": True} if self_kernel else {}  # the runner's builder options
            variants = [(f"engine path, {layout}", decoder, padding, dict(engine))]
            if spacing == 1 and packed:
                variants.append(("MKL linears, rows padded to 16 (before)", mkl_decoder, 8, {}))
            if kernels:
                variants.append((f"engine path, {layout}, torch cross-attention", decoder, padding,
                                 {"kernel": False, **engine}))
            if self_kernel and spacing == 1:
                variants.append(("engine path, torch self-attention", decoder, padding, {}))
            if onednn_decoder is not None and spacing == 1:
                variants.append(("engine path, oneDNN linears", onednn_decoder, padding,
                                 dict(engine)))
            if has_reference and spacing == 1:
                variants.append(("gathered reference", decoder, padding, {"cross_in_place": False}))
            for name, decoder_variant, padding_multiple, options in variants:
                kernel = options.pop("kernel", True)
                builder = DecoderInputBuilder(block_size, dims.n_audio_ctx, padding_multiple, {}, cpu, **options)

                def step(builder=builder, batch=batch, kv_cache=kv_cache, decoder=decoder_variant, kernel=kernel):
                    inputs = builder.build(batch)
                    uses_kernel = attention.uses_cpu_kernel
                    attention.uses_cpu_kernel = uses_kernel if kernel else lambda query: False
                    try:
                        hidden = decoder(inputs.input_ids, inputs.positions, kv_cache, inputs.metadata)
                    finally:
                        attention.uses_cpu_kernel = uses_kernel
                    return decoder.compute_logits(hidden[inputs.logits_indices])

                steps[f"{n} requests, {name}"] = step
    timings: dict[str, list[float]] = {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            timings[name].append(per_call_ms(step, repeats))
    return [(name, statistics.median(values)) for name, values in timings.items()]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--batch", type=int, default=8, help="audios per encoder call")
    parser.add_argument("--requests", default="8,32", help="decoding requests for the cross-attention rows")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--only", choices=("encoder", "encoder-float32", "cross-attention", "sampler", "decode-step"), help="one section only")
    parser.add_argument("--decode-dtype", default="float32", choices=("float32", "bfloat16"),
                        help="the decode-step section's dtype (bfloat16: the default on CPUs with native bf16)")
    args = parser.parse_args()
    requests = [int(n) for n in args.requests.split(",")]
    print(f"{torch.get_num_threads()} threads, torch {torch.__version__}")
    if args.only in (None, "encoder", "encoder-float32"):
        print(f"\nencoder, batch of {args.batch}: ms per 30 s window, lowest-highest of 3 rounds")
        for name, ms_range in float32_encoder_rows(args.batch, max(1, args.repeats // 2)):
            print(f"  {name:<52}{ms_range:>12}")
    if args.only in (None, "encoder"):
        print(f"\nencoder, batch of {args.batch}: ms per 30 s window")
        for name, ms in encoder_rows(args.batch, args.repeats):
            print(f"  {name:<44}{ms:>8.1f}")
    if args.only in (None, "cross-attention"):
        print("\ndecoder cross-attention, one layer, bfloat16: ms per step")
        for name, ms in cross_attention_rows(requests, 4 * args.repeats):
            print(f"  {name:<48}{ms:>8.2f}")
    if args.only in (None, "sampler"):
        print("\nsampler's last pass, float32 logits [rows, 51865]: ms per step")
        for name, ms in sampler_rows(requests, 4 * args.repeats):
            print(f"  {name:<48}{ms:>8.2f}")
    if args.only in (None, "decode-step"):
        dtype = getattr(torch, args.decode_dtype)
        print(f"\ndecode step, tiny.en, {args.decode_dtype}: ms per step (decoder forward and logits)")
        for name, ms in decode_step_rows(requests, 2 * args.repeats, dtype=dtype):
            print(f"  {name:<68}{ms:>8.2f}")


if __name__ == "__main__":
    main()
