"""asrserve next to its peers, in one run: same machine, same tiny.en weights, same audio.

    pip install -e '.[bench]'
    python benchmarks/peers.py [--workloads mixed,short,long] [--decoding defaults|once] [--systems ...]
                               [--repeats 3] [--save-result peers.json]

Workloads (all with reference texts, WER with Whisper's English normaliser):
  mixed  42 short clips (benchmarks/workloads.mixed_clips): espeak-ng sentences, some under
         noise, and ../shared/audio's real recordings of up to 30 s, five of them not English.
  short  32 Harvard sentences spoken by espeak-ng, ~2.4 s each (76 s in all).
  long   2 recordings of ~112 s: the English recordings of ../shared/audio joined with 0.5 s
         pauses (real speech; espeak-ng sentences without the folder).

--decoding defaults (the default): what a user gets without asking. Greedy, then Whisper's
temperature fallback (0.2 ... 1.0, best_of 5, compression ratio 2.4, log-probability -1.0,
no-speech 0.6) on asrserve (OpenAI's defaults) and faster-whisper (its defaults, beam_size 1).
transformers is left out: its short-form generate has no fallback.
--decoding once: one greedy decode per 30 s window everywhere (temperature_fallback=false).

Systems, each in its own process (no thread or allocator settings leak between them), short
clips without timestamps, long audio with them (Whisper's long-form mode: without timestamp
tokens, tiny.en drops whole sentences of a dense 30 s window, and every system's WER is near
50%):
  asrserve-offline[-fp32]    the engine in-process (`ASR`), every file submitted at once
  asrserve-http              `asrserve serve` as a subprocess, loaded by `asrserve bench`'s load
                             generator at --concurrency (default 8)
  asrserve-http-bf16-encoder the same with `--encoder-quantization none` (the encoder's linears
                             in bf16, not int8)
  asrserve-http-encoder-batch-8   the same with `--max-encoder-batch 8` (on CPU the default is 1)
  transformers               `WhisperForConditionalGeneration.generate`, batched; its best batch
                             size of 8/16/32 (long-form generation for the long workload)
  faster-whisper-*           one file at a time (int8, float32); int8 with two workers on one
                             thread each (two files at once: its best on 2 cores); and its
                             BatchedInferencePipeline (int8, batch 8)

RTFx = seconds of audio / wall seconds for the whole set, the median of --repeats passes after
a warm-up (asrserve-http: --repeats passes' worth of requests in one timed run).
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asrserve import ASR
from asrserve.audio.decode import load_audio
from asrserve.benchmark.load_generator import LoadSpec, run_load
from asrserve.benchmark.report import summarize
from asrserve.benchmark.wer import corpus_wer, english_normalizer
from asrserve.benchmark.workload import load_workload, read_manifest
from asrserve.config import cpu_has_native_bf16
from asrserve.model.loader import _bundled
from asrserve.model.tokenizer import WhisperTokenizer
from benchmarks.workloads import long_recordings, mixed_clips, short_clips, write_manifest

FAST_DTYPE = "bfloat16" if cpu_has_native_bf16() else "float32"  # what --dtype auto picks here


def timed(run, audios, repeats: int) -> tuple[float, list[str]]:
    """Median wall time of `repeats` passes over all files, after a warm-up on a few."""
    run(audios[: min(4, len(audios))])
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        texts = run(audios)
        walls.append(time.perf_counter() - start)
    return statistics.median(walls), texts


FALLBACK = True  # --decoding defaults; main sets it, and passes it to its workers


def asrserve_offline(dtype: str, timestamps: bool):
    asr = ASR(dtype=dtype, max_num_seqs=64)
    run = lambda audios: [t.text for t in asr.transcribe(audios, fallback=FALLBACK, timestamps=timestamps)]  # noqa: E731
    return {"dtype": dtype, "timestamps": timestamps}, run


def transformers_generate(long_form: bool):
    """The model loaded once; returns run(batch_size) -> (config, transcribe function)."""
    from transformers import WhisperFeatureExtractor

    from tests.hf_reference import bundled_hf_model

    model, generation = bundled_hf_model("tiny.en")
    dtype = getattr(torch, FAST_DTYPE)
    model = model.to(dtype)
    extractor = WhisperFeatureExtractor()
    tokenizer = WhisperTokenizer.from_dir(_bundled("tiny.en").directories[0], model.config.vocab_size)

    def run(audios, batch_size):
        texts = []
        for start in range(0, len(audios), batch_size):
            batch = audios[start:start + batch_size]
            if long_form:  # more than 30 s: transformers' sequential long-form generation
                inputs = extractor(batch, sampling_rate=16000, return_tensors="pt", truncation=False,
                                   padding="longest", return_attention_mask=True)
                options = dict(attention_mask=inputs.attention_mask, return_timestamps=True,
                               condition_on_prev_tokens=False)
            else:
                inputs = extractor(batch, sampling_rate=16000, return_tensors="pt")
                options = dict(return_timestamps=False)
            with torch.inference_mode():
                out = model.generate(inputs.input_features.to(dtype), generation_config=generation, **options)
            texts += [tokenizer.decode(row) for row in out.tolist()]
        return texts

    return lambda batch_size: ({"dtype": FAST_DTYPE, "batch_size": batch_size},
                               lambda audios: run(audios, batch_size))


def faster_whisper(compute_type: str, timestamps: bool, workers: int = 1, batched: bool = False):
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    directory = str(_bundled("tiny.en").directories[0])
    cpus = os.cpu_count() or 2
    model = WhisperModel(directory, device="cpu", compute_type=compute_type, cpu_threads=max(1, cpus // workers),
                         num_workers=workers)
    # With fallback: faster-whisper's own defaults (temperatures 0, 0.2 ... 1.0, best_of 5, its
    # thresholds), greedy at temperature 0.
    temperature = [0.0, 0.2, 0.4, 0.6, 0.8, 1.0] if FALLBACK else 0.0
    options = dict(language="en", beam_size=1, temperature=temperature, without_timestamps=not timestamps,
                   condition_on_previous_text=False)
    config = {"compute_type": compute_type, "workers": workers, "cpu_threads": max(1, cpus // workers),
              "timestamps": timestamps, "fallback": FALLBACK}
    if batched:
        pipeline = BatchedInferencePipeline(model)
        # The pipeline batches the VAD segments of one input: one segment per short clip.
        one = lambda audio: "".join(s.text for s in pipeline.transcribe(audio, batch_size=8, **options)[0])  # noqa: E731
        return config | {"batch_size": 8}, lambda audios: [one(a) for a in audios]
    one = lambda audio: "".join(s.text for s in model.transcribe(audio, vad_filter=False, **options)[0])  # noqa: E731
    if workers == 1:
        return config, lambda audios: [one(a) for a in audios]
    pool = ThreadPoolExecutor(workers)
    return config, lambda audios: list(pool.map(one, audios))


FACTORIES = {
    "asrserve-offline": lambda long: asrserve_offline(FAST_DTYPE, timestamps=long),
    "asrserve-offline-fp32": lambda long: asrserve_offline("float32", timestamps=long),
    "transformers": None,  # chooses its batch size in measure()
    "faster-whisper-int8": lambda long: faster_whisper("int8", timestamps=long),
    "faster-whisper-fp32": lambda long: faster_whisper("float32", timestamps=long),
    "faster-whisper-int8-2workers": lambda long: faster_whisper("int8", timestamps=long, workers=2),
    "faster-whisper-batched-int8": lambda long: faster_whisper("int8", timestamps=long, batched=True),
}
# The asrserve-http systems: `asrserve serve`'s arguments beyond the common ones.
HTTP_SYSTEMS = {"asrserve-http": [], "asrserve-http-bf16-encoder": ["--encoder-quantization", "none"],
                "asrserve-http-encoder-batch-8": ["--max-encoder-batch", "8"]}
SYSTEMS = ["asrserve-offline", "asrserve-offline-fp32", *HTTP_SYSTEMS, *list(FACTORIES)[2:]]


def measure_in_process(name: str, directory: Path, repeats: int, long: bool) -> dict:
    references = read_manifest(directory / "manifest.tsv")
    audios = [load_audio(directory / file) for file in references]
    if name == "transformers":
        with_batch_size = transformers_generate(long)
        sizes = [2] if long else [8, 16, 32]
        tried = {}
        for size in sizes:  # its best batch size, on one timed pass each
            tried[size] = timed(with_batch_size(size)[1], audios, 1)[0]
        config, run = with_batch_size(min(tried, key=tried.get))
        config["batch_sizes_tried"] = {str(k): round(v, 2) for k, v in tried.items()}
    else:
        config, run = FACTORIES[name](long)
        config["fallback"] = FALLBACK
    wall, texts = timed(run, audios, repeats)
    audio_seconds = sum(len(a) for a in audios) / 16000
    return {
        "system": name, "config": config, "audio_seconds": audio_seconds, "wall_seconds": wall,
        "rtfx": audio_seconds / wall, "wer": corpus_wer(list(references.values()), texts, english_normalizer()),
    }


def measure_http(directory: Path, repeats: int, concurrency: int, long: bool, name: str = "asrserve-http") -> dict:
    from tests.server_utils import ServerProcess

    files = load_workload(directory, directory / "manifest.tsv")
    server = ServerProcess(["--dtype", FAST_DTYPE, "--max-num-seqs", "64", *HTTP_SYSTEMS[name]])
    try:
        server.wait_ready()
        spec = LoadSpec(url=server.url, model="tiny.en", concurrency=concurrency, progress=False,
                        response_format="verbose_json" if long else "json",
                        num_requests=min(8, len(files)),
                        fields=() if FALLBACK else (("temperature_fallback", "false"),))
        asyncio.run(run_load(spec, files))  # warm-up
        spec = dataclasses.replace(spec, num_requests=max(len(files) * repeats, 2 * concurrency))
        summary = summarize(asyncio.run(run_load(spec, files)), files)
    finally:
        server.stop()
    return {
        "system": name,
        "config": {"args": HTTP_SYSTEMS[name], "dtype": FAST_DTYPE, "concurrency": concurrency, "timestamps": long, "fallback": FALLBACK},
        "audio_seconds": summary["audio_seconds"], "wall_seconds": summary["wall_seconds"],
        "rtfx": summary["rtfx"], "wer": summary.get("wer"), "failed": summary["failed"],
        "latency_ms": summary["latency_ms"],
    }


def run_workload(workload: str, systems: list[str], repeats: int, concurrency: int) -> list[dict]:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        if workload == "mixed":
            references = mixed_clips(directory)
        elif workload == "short":
            references = short_clips(32, directory)
        else:
            references = long_recordings(2, 90, directory)
        write_manifest(directory, references)
        print(f"\n{workload}: {len(references)} files", flush=True)
        print(f"{'system':<32}{'audio s':>9}{'wall s':>9}{'RTFx':>8}{'WER %':>8}", flush=True)
        for name in systems:
            if name in HTTP_SYSTEMS:
                result = measure_http(directory, repeats, concurrency, workload == "long", name)
            else:
                worker = subprocess.run(
                    [sys.executable, __file__, "--worker", name, "--dir", tmp, "--repeats", str(repeats),
                     "--decoding", "defaults" if FALLBACK else "once"]
                    + (["--long"] if workload == "long" else []),
                    capture_output=True, text=True,
                )
                if worker.returncode != 0:
                    print(f"{name:<32} failed:\n{worker.stderr[-2000:]}", flush=True)
                    continue
                result = json.loads(worker.stdout.strip().splitlines()[-1])
            results.append(result | {"workload": workload})
            print(f"{name:<32}{result['audio_seconds']:>9.1f}{result['wall_seconds']:>9.2f}{result['rtfx']:>8.1f}"
                  f"{100 * (result['wer'] or 0):>8.1f}", flush=True)
    return results


def ratios(results: list[dict]) -> dict:
    """asrserve's RTFx over each peer's, per workload; and over the best faster-whisper."""
    out = {}
    for workload in sorted({r["workload"] for r in results}):
        rows = {r["system"]: r["rtfx"] for r in results if r["workload"] == workload}
        peers = {k: v for k, v in rows.items() if not k.startswith("asrserve")}
        fw = {k: v for k, v in peers.items() if k.startswith("faster-whisper")}
        for ours in (*HTTP_SYSTEMS, "asrserve-offline"):
            if ours in rows:
                if fw:
                    out[f"{workload}: {ours} / best faster-whisper"] = round(rows[ours] / max(fw.values()), 2)
                for peer, rtfx in peers.items():
                    out[f"{workload}: {ours} / {peer}"] = round(rows[ours] / rtfx, 2)
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--workloads", default="mixed,short,long")
    parser.add_argument("--decoding", choices=["defaults", "once"], default="defaults",
                        help="defaults: temperature fallback on everywhere (what users get); once: one greedy decode")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per system; the median is reported")
    parser.add_argument("--concurrency", type=int, default=8, help="asrserve-http: requests in flight")
    parser.add_argument("--save-result", type=Path, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, default=None, help=argparse.SUPPRESS)
    parser.add_argument("--long", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()

    global FALLBACK
    FALLBACK = args.decoding == "defaults"
    if args.worker:  # one system, in its own process
        print(json.dumps(measure_in_process(args.worker, args.dir, args.repeats, args.long)))
        return
    systems = args.systems.split(",")
    if FALLBACK and "transformers" in systems:
        print("transformers left out: its short-form generate has no temperature fallback")
        systems.remove("transformers")
    unknown = set(systems) - set(SYSTEMS)
    if unknown:
        sys.exit(f"unknown systems {sorted(unknown)}; choose from {', '.join(SYSTEMS)}")
    print(f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), torch {torch.__version__}, "
          f"asrserve dtype {FAST_DTYPE}, decoding: {args.decoding}")
    results = []
    for workload in args.workloads.split(","):
        results += run_workload(workload, systems, args.repeats, args.concurrency)
    summary = ratios(results)
    print()
    for key, value in summary.items():
        print(f"{key:<64}{value:>6}")
    if args.save_result:
        args.save_result.write_text(json.dumps({
            "cpus": os.cpu_count(), "repeats": args.repeats, "torch": torch.__version__, "decoding": args.decoding,
            "machine": platform.processor() or platform.machine(), "results": results, "ratios": summary,
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()
