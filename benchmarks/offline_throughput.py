"""Offline throughput on short clips: asrserve's engine next to transformers `generate` and
faster-whisper, same machine, same tiny.en weights, same clips, greedy decoding.

    python benchmarks/offline_throughput.py [--clips 32] [--save-result out.json]

The clips are Harvard sentences spoken by espeak-ng (about 2.4 s each). Each system runs in its
own process; RTFx = seconds of audio / wall-clock seconds for the whole set (the median of
--repeats passes, after a warm-up). WER is against
the sentences that were spoken (lower-cased, punctuation dropped).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asrserve import ASR
from asrserve.audio.decode import load_audio
from asrserve.model.loader import _bundled
from asrserve.model.tokenizer import WhisperTokenizer
from tests.wer import corpus_wer

# Harvard sentences, lists 1-4 (public domain).
SENTENCES = [
    "The birch canoe slid on the smooth planks.", "Glue the sheet to the dark blue background.",
    "It's easy to tell the depth of a well.", "These days a chicken leg is a rare dish.",
    "Rice is often served in round bowls.", "The juice of lemons makes fine punch.",
    "The box was thrown beside the parked truck.", "The hogs were fed chopped corn and garbage.",
    "Four hours of steady work faced us.", "A large size in stockings is hard to sell.",
    "The boy was there when the sun rose.", "A rod is used to catch pink salmon.",
    "The source of the huge river is the clear spring.", "Kick the ball straight and follow through.",
    "Help the woman get back to her feet.", "A pot of tea helps to pass the evening.",
    "Smoky fires lack flame and heat.", "The soft cushion broke the man's fall.",
    "The salt breeze came across from the sea.", "The girl at the booth sold fifty bonds.",
    "The small pup gnawed a hole in the sock.", "The fish twisted and turned on the bent hook.",
    "Press the pants and sew a button on the vest.", "The swan dive was far short of perfect.",
    "The beauty of the view stunned the young boy.", "Two blue fish swam in the tank.",
    "Her purse was full of useless trash.", "The colt reared and threw the tall rider.",
    "It snowed, rained, and hailed the same morning.", "Read verse out loud for pleasure.",
    "Hoist the load to your left shoulder.", "Take the winding path to reach the lake.",
]


def spoken_texts(count: int) -> list[str]:
    return [SENTENCES[i % len(SENTENCES)] for i in range(count)]


def make_clips(count: int, directory: Path) -> None:
    for i, text in enumerate(spoken_texts(count)):
        path = directory / f"clip{i:02d}.wav"
        subprocess.run(["espeak-ng", "-v", "en-us", "-w", str(path), text], check=True, capture_output=True)


def timed(run, audios, repeats: int) -> tuple[float, list[str]]:
    """Median wall time of `repeats` passes over all clips, after a warm-up on a few."""
    run(audios[: min(4, len(audios))])
    walls = []
    for _ in range(repeats):
        start = time.perf_counter()
        texts = run(audios)
        walls.append(time.perf_counter() - start)
    return statistics.median(walls), texts


def bench_asrserve(dtype: str):
    asr = ASR(dtype=dtype, max_num_seqs=64, max_encoder_batch=8)
    return lambda audios: [t.text for t in asr.transcribe(audios, fallback=False)]  # greedy, once, like the peers


def bench_transformers(batch_size: int):
    from transformers import WhisperFeatureExtractor

    from tests.hf_reference import bundled_hf_model

    model, generation = bundled_hf_model("tiny.en")
    extractor = WhisperFeatureExtractor()
    # Decode with the same tokenizer as asrserve.
    tokenizer = WhisperTokenizer.from_dir(_bundled("tiny.en").directories[0], model.config.vocab_size)

    def run(audios):
        texts = []
        for start in range(0, len(audios), batch_size):
            batch = audios[start:start + batch_size]
            features = extractor(batch, sampling_rate=16000, return_tensors="pt").input_features
            with torch.inference_mode():
                out = model.generate(features, generation_config=generation, return_timestamps=False)
            texts += [tokenizer.decode(row.tolist()) for row in out]
        return texts

    return run


def bench_faster_whisper(compute_type: str, batched: bool):
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    directory = _bundled("tiny.en").directories[0]
    model = WhisperModel(str(directory), device="cpu", compute_type=compute_type, cpu_threads=os.cpu_count() or 2)
    options = dict(language="en", beam_size=1, temperature=0.0, without_timestamps=True,
                   condition_on_previous_text=False)
    if batched:
        pipeline = BatchedInferencePipeline(model)

        def run(audios):
            # The pipeline batches the VAD segments of one input; clips of ~3 s are one segment
            # each, so each call is one batch of one.
            return ["".join(s.text for s in pipeline.transcribe(a, batch_size=8, **options)[0]) for a in audios]

        return run

    def run(audios):
        return ["".join(s.text for s in model.transcribe(a, vad_filter=False, **options)[0]) for a in audios]

    return run


FACTORIES = {
    "asrserve-fp32": lambda: bench_asrserve("float32"),
    "asrserve-bf16": lambda: bench_asrserve("bfloat16"),
    "transformers-b8": lambda: bench_transformers(8),
    "faster-whisper-fp32": lambda: bench_faster_whisper("float32", batched=False),
    "faster-whisper-int8": lambda: bench_faster_whisper("int8", batched=False),
    "faster-whisper-batched-int8": lambda: bench_faster_whisper("int8", batched=True),
}


def measure(name: str, clips_dir: Path, repeats: int) -> dict:
    audios = [load_audio(path) for path in sorted(clips_dir.glob("clip*.wav"))]
    run = FACTORIES[name]()
    wall, texts = timed(run, audios, repeats)
    audio_seconds = sum(len(a) for a in audios) / 16000
    return {
        "system": name, "audio_seconds": audio_seconds, "wall_seconds": wall, "rtfx": audio_seconds / wall,
        "wer": corpus_wer(spoken_texts(len(audios)), texts),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--clips", type=int, default=32)
    parser.add_argument("--systems", default=",".join(FACTORIES))
    parser.add_argument("--repeats", type=int, default=3, help="timed passes per system; the median is reported")
    parser.add_argument("--save-result", type=Path, default=None)
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--clips-dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:  # one system, in its own process: no allocator or thread settings leak between systems
        print(json.dumps(measure(args.worker, args.clips_dir, args.repeats)))
        return

    with tempfile.TemporaryDirectory() as tmp:
        make_clips(args.clips, Path(tmp))
        print(f"{args.clips} clips, {os.cpu_count()} CPUs, torch {torch.__version__}")
        print(f"{'system':<30}{'audio s':>9}{'wall s':>9}{'RTFx':>9}{'WER %':>8}")
        results = []
        for name in args.systems.split(","):
            worker = subprocess.run(
                [sys.executable, __file__, "--worker", name, "--clips", str(args.clips), "--clips-dir", tmp,
                 "--repeats", str(args.repeats)],
                capture_output=True, text=True, check=True,
            )
            result = json.loads(worker.stdout.strip().splitlines()[-1])
            results.append(result)
            audio, wall, rtfx = result["audio_seconds"], result["wall_seconds"], result["rtfx"]
            wer = 100 * result["wer"]
            print(f"{name:<30}{audio:>9.1f}{wall:>9.2f}{rtfx:>9.1f}{wer:>8.1f}", flush=True)
    if args.save_result:
        args.save_result.write_text(json.dumps({
            "clips": args.clips, "cpus": os.cpu_count(), "repeats": args.repeats,
            "machine": platform.processor() or platform.machine(), "torch": torch.__version__, "results": results,
        }, indent=2))


if __name__ == "__main__":
    main()
