"""The GPU benchmark of issue 18, offline parts: the engine alone and transformers `generate`.

Workload: 30 s audios (noise and tones: dummy weights need no speech), each decoding a fixed
90 tokens (<|endoftext|> banned), greedy, language given, no fallback. Prints and writes JSON:
- engine RTFx at each concurrency (max_num_seqs = concurrency, 2x as many requests as slots);
- decode step time at that many running requests (steps with no encoder work), and the
  encoder's time per audio at several batch sizes;
- transformers WhisperForConditionalGeneration.generate on the same architecture (its own
  random weights, the same dtype), 90 new tokens forced, at several batch sizes;
- a torch.profiler table of a few decode steps and one encoder forward.

    python benchmarks/gpu_bench.py MODEL_DIR --out result.json [--concurrency 64 256]

MODEL_DIR holds a Hugging Face config.json and tokenizer.json (benchmarks/gpu_prepare.py
writes one for large-v3-turbo); weights are random (--load-format dummy).
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asrserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from asrserve.engine.engine_core import EngineCore  # noqa: E402
from asrserve.engine.request import SamplingParams  # noqa: E402

SAMPLE_RATE = 16000
CLIP_S = 30.0
OUTPUT_TOKENS = 90


def clips(count: int, seed: int = 0) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    t = np.arange(int(SAMPLE_RATE * CLIP_S)) / SAMPLE_RATE
    out = []
    for index in range(count):
        tone = 0.1 * np.sin(2 * np.pi * (150 + 7 * index) * t)
        out.append((tone + 0.05 * rng.standard_normal(t.size)).astype(np.float32))
    return out


def write_clips(directory: Path, count: int) -> None:
    """The same clips as 16-bit WAV files, for the HTTP run (asrserve bench)."""
    import wave

    directory.mkdir(parents=True, exist_ok=True)
    for index, audio in enumerate(clips(count, seed=5)):
        with wave.open(str(directory / f"clip{index:03d}.wav"), "wb") as out:
            out.setnchannels(1)
            out.setsampwidth(2)
            out.setframerate(SAMPLE_RATE)
            out.writeframes((np.clip(audio, -1, 1) * 32767).astype("<i2").tobytes())


def sync() -> None:
    torch.cuda.synchronize()


def run_engine(model_dir: str, dtype: str, concurrency: int, encoder_batch: int,
               audios: list[np.ndarray], enforce_eager: bool = False) -> tuple[dict, EngineCore]:
    config = EngineConfig(
        model=ModelConfig(model=model_dir, load_format="dummy", dtype=dtype, enforce_eager=enforce_eager),
        cache=CacheConfig(),
        scheduler=SchedulerConfig(max_num_seqs=concurrency, max_encoder_batch=encoder_batch),
    )
    started = time.perf_counter()
    engine = EngineCore(config)
    load_s = time.perf_counter() - started
    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True)

    step_log: list[tuple[int, int, float]] = []  # (encoder audios, scheduled requests, seconds)
    execute = engine.runner.execute

    def timed_execute(scheduler_output):
        sync()
        began = time.perf_counter()
        sampled = execute(scheduler_output)
        sync()
        step_log.append((len(scheduler_output.encoder_requests), len(scheduler_output.scheduled),
                         time.perf_counter() - began))
        return sampled

    engine.runner.execute = timed_execute

    def run(batch: list[np.ndarray], tag: str) -> tuple[float, int]:
        for i, audio in enumerate(batch):
            engine.add_request(f"{tag}{i}", audio, language="en", sampling_params=params)
        began = time.perf_counter()
        tokens = 0
        while engine.has_work():
            for output in engine.step():
                tokens += len(output.new_token_ids)
        return time.perf_counter() - began, tokens

    run(audios[: min(len(audios), concurrency)], "warm")  # allocator, cuBLAS heuristics
    step_log.clear()
    wall, tokens = run(audios, "r")
    decode_steps = [s for e, n, s in step_log if e == 0 and n == concurrency]
    encoder_steps = [(e, s) for e, n, s in step_log if e > 0]
    result = {
        "concurrency": concurrency,
        "requests": len(audios),
        "audio_s": len(audios) * CLIP_S,
        "wall_s": round(wall, 3),
        "rtfx": round(len(audios) * CLIP_S / wall, 1),
        "output_tokens": tokens,
        "steps": len(step_log),
        "decode_step_ms_at_full_batch": _stats_ms(decode_steps),
        "encoder_steps": len(encoder_steps),
        "encoder_step_ms": _stats_ms([s for _, s in encoder_steps]),
        "time_in_steps_s": round(sum(s for _, _, s in step_log), 3),
        "kv_blocks": engine.runner.num_kv_blocks,
        "cuda_graphs": engine.runner.decode_graphs is not None,
        "encoder_compiled": engine.runner.encode is not engine.runner.model.encoder,
        "load_s": round(load_s, 1),  # weights, encoder compilation, graph capture
        "dtype": str(engine.dtype).removeprefix("torch."),
    }
    engine.runner.execute = execute
    return result, engine


def _stats_ms(seconds: list[float]) -> dict:
    if not seconds:
        return {}
    ms = np.asarray(seconds) * 1000
    return {"n": len(ms), "p50": round(float(np.median(ms)), 2), "mean": round(float(ms.mean()), 2),
            "p90": round(float(np.percentile(ms, 90)), 2)}


def encoder_per_audio(engine: EngineCore, batch_sizes: list[int]) -> dict:
    runner = engine.runner
    out = {}
    with torch.inference_mode():
        for batch in batch_sizes:
            mel = runner.log_mel(clips(batch, seed=1)).to(runner.dtype)
            runner.encode(mel)
            sync()
            began = time.perf_counter()
            repeats = 3
            for _ in range(repeats):
                runner.encode(mel)
            sync()
            out[str(batch)] = round((time.perf_counter() - began) / repeats / batch * 1000, 2)
            del mel
        audios = clips(64, seed=2)
        runner.log_mel(audios)
        sync()
        began = time.perf_counter()
        runner.log_mel(audios)
        sync()
        out["log_mel_per_audio_ms_at_64"] = round((time.perf_counter() - began) / 64 * 1000, 3)
    return out


def encoder_compiled(engine: EngineCore, batch: int, profile_path: Path | None) -> dict:
    """The encoder through torch.compile (what --compile auto runs on CUDA in 16-bit) against
    eager: time per audio at one batch size, and the relative difference of the outputs."""
    from asrserve.model.encoder_compile import compiled_encoder

    runner = engine.runner
    out = {}
    compiled = runner.encode
    if compiled is runner.model.encoder:  # the engine did not compile it
        started = time.perf_counter()
        compiled = compiled_encoder(runner.model.encoder, runner.dims.n_mels, runner.device, runner.dtype, "on")
        out["compile_s"] = round(time.perf_counter() - started, 1)
    with torch.inference_mode():
        mel = runner.log_mel(clips(batch, seed=1)).to(runner.dtype)
        for name, encode in (("eager", runner.model.encoder), ("compiled", compiled)):
            encode(mel)
            sync()
            began = time.perf_counter()
            for _ in range(3):
                encoded = encode(mel)
            sync()
            out[f"{name}_ms_per_audio"] = round((time.perf_counter() - began) / 3 / batch * 1000, 2)
            out.setdefault("outputs", []).append(encoded.float())
        eager, fast = out.pop("outputs")
        out["max_relative_difference"] = round(((fast - eager).norm() / eager.norm()).item(), 5)
        if profile_path is not None:
            from torch.profiler import ProfilerActivity
            from torch.profiler import profile as torch_profile

            with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
                runner.model.encoder(mel)
                sync()
            profile_path.write_text(f"eager encoder, batch {batch}\n\n"
                                    + prof.key_averages().table(sort_by="cuda_time_total", row_limit=20))
    out["batch"] = batch
    return out


def profile(engine: EngineCore, concurrency: int, path: Path) -> None:
    from torch.profiler import ProfilerActivity
    from torch.profiler import profile as torch_profile

    params = SamplingParams(max_tokens=OUTPUT_TOKENS, ignore_eos=True)
    for i, audio in enumerate(clips(concurrency, seed=3)):
        engine.add_request(f"p{i}", audio, language="en", sampling_params=params)
    while engine.scheduler.waiting or any(not r.output_token_ids for r in engine.scheduler.running):
        engine.step()
    with torch_profile(activities=[ProfilerActivity.CPU, ProfilerActivity.CUDA]) as prof:
        for _ in range(10):
            engine.step()
        sync()
    table = prof.key_averages().table(sort_by="cuda_time_total", row_limit=25)
    table_cpu = prof.key_averages().table(sort_by="cpu_time_total", row_limit=20)
    path.write_text(f"10 decode steps at {len(engine.scheduler.running)} running\n\n{table}\n\n{table_cpu}\n")
    while engine.has_work():
        engine.step()


def transformers_generate(model_dir: str, dtype: torch.dtype, batch_sizes: list[int], num_audios: int) -> dict:
    from transformers import GenerationMixin, WhisperConfig, WhisperForConditionalGeneration

    from asrserve.audio.features import LogMelSpectrogram

    config = WhisperConfig.from_pretrained(model_dir)
    torch.manual_seed(0)
    with torch.device("cuda"):
        model = WhisperForConditionalGeneration(config).to(dtype).eval()
    log_mel = LogMelSpectrogram(config.num_mel_bins, torch.device("cuda"))
    sot, en, transcribe, no_ts = 50258, 50259, 50360, 50364  # large-v3 ids (51866 vocabulary)
    results = {}
    for batch in batch_sizes:
        audios = clips(batch, seed=4)
        features = log_mel(audios).to(dtype)
        prompt = torch.tensor([[sot, en, transcribe, no_ts]] * batch, device="cuda")

        def generate():
            # The generic loop (no Whisper-specific long-form logic): forced length, greedy.
            return GenerationMixin.generate(
                model, input_features=features, decoder_input_ids=prompt, max_new_tokens=OUTPUT_TOKENS,
                min_new_tokens=OUTPUT_TOKENS, do_sample=False, num_beams=1, eos_token_id=config.eos_token_id,
                pad_token_id=config.eos_token_id,
            )

        with torch.inference_mode():
            out = generate()
            assert out.shape[1] >= OUTPUT_TOKENS, out.shape
            sync()
            rounds = max(1, num_audios // batch)
            began = time.perf_counter()
            for _ in range(rounds):
                generate()
            sync()
            wall = time.perf_counter() - began
        results[str(batch)] = {"rtfx": round(rounds * batch * CLIP_S / wall, 1), "wall_s": round(wall, 2)}
        print(f"transformers batch {batch}: RTFx {results[str(batch)]['rtfx']}", flush=True)
    return results


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("model_dir")
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--write-clips", type=int, default=0, metavar="N",
                        help="only write N clips as WAV files into --out (a folder) and stop")
    parser.add_argument("--profile-out", type=Path, default=None)
    parser.add_argument("--concurrency", type=int, nargs="+", default=[64, 256])
    parser.add_argument("--requests-per-slot", type=int, default=2)
    parser.add_argument("--encoder-batch", type=int, default=32)
    parser.add_argument("--dtype", default="bfloat16")
    parser.add_argument("--hf-batch-sizes", type=int, nargs="+", default=[32, 64, 128])
    parser.add_argument("--skip-hf", action="store_true")
    parser.add_argument("--encoder-compile", action="store_true", help="also time the encoder through torch.compile")
    parser.add_argument("--eager-concurrency", type=int, nargs="*", default=[],
                        help="also run the engine at these concurrencies with --enforce-eager (no CUDA graphs)")
    args = parser.parse_args()
    if args.write_clips:
        write_clips(args.out, args.write_clips)
        return 0

    result = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "model_dir": args.model_dir,
              "clip_s": CLIP_S, "output_tokens": OUTPUT_TOKENS, "date": time.strftime("%Y-%m-%d"), "engine": [],
              "engine_eager": []}
    engine = None
    # --enforce-eager rows first: the last engine (CUDA graphs, the largest concurrency) is the
    # one the encoder timings and the profile below use.
    runs = [(c, True) for c in args.eager_concurrency] + [(c, False) for c in args.concurrency]
    for concurrency, enforce_eager in runs:
        engine = None
        torch.cuda.empty_cache()
        row, engine = run_engine(args.model_dir, args.dtype, concurrency, args.encoder_batch,
                                 clips(args.requests_per_slot * concurrency), enforce_eager=enforce_eager)
        print(json.dumps(row), flush=True)
        result["engine_eager" if enforce_eager else "engine"].append(row)
        args.out.write_text(json.dumps(result, indent=1))
    result["encoder_ms_per_audio"] = encoder_per_audio(engine, [1, 8, 16, 32, 64])
    print("encoder ms per audio", result["encoder_ms_per_audio"], flush=True)
    if args.encoder_compile:
        profile_path = args.profile_out.with_name("encoder_profile.txt") if args.profile_out else None
        result["encoder_compiled"] = encoder_compiled(engine, 32, profile_path)
        print("encoder compiled", result["encoder_compiled"], flush=True)
    if args.profile_out:
        profile(engine, args.concurrency[-1], args.profile_out)
    del engine
    torch.cuda.empty_cache()
    args.out.write_text(json.dumps(result, indent=1))
    if not args.skip_hf:
        dtype = getattr(torch, args.dtype)
        result["transformers"] = transformers_generate(args.model_dir, dtype, args.hf_batch_sizes, 256)
        best = max(v["rtfx"] for v in result["transformers"].values())
        ours = max(r["rtfx"] for r in result["engine"])
        result["speedup_over_transformers"] = round(ours / best, 2)
        print(f"engine best RTFx {ours} vs transformers best {best}: {ours / best:.2f}x", flush=True)
    args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
