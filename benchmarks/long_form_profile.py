"""Where the time goes when asrserve transcribes long audio offline: engine steps by decoder
batch size, the steps that ran the encoder, pieces, continuations and samples, and WER.

    python benchmarks/long_form_profile.py [--model tiny.en] [--set real-en] [--repeats 1] [--dtype auto]

The set is one of benchmarks/long_form.py's (built the same way); every file goes to one
ASR.transcribe call with OpenAI's defaults, as long_form.py's asrserve-auto-seek system does.
Each step's runner time is taken around ModelRunner.execute (encoder, decoder, sampler).
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import soundfile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asrserve import ASR
from asrserve.benchmark.wer import corpus_wer
from benchmarks.long_form import build_sets, normalizer_for

BUCKETS = [(1, 3), (4, 7), (8, 15), (16, 31), (32, 63), (64, 1 << 30)]


def profile(asr: ASR, files: list[dict], directory: Path) -> dict:
    audios = [soundfile.read(directory / entry["file"], dtype="float32")[0] for entry in files]
    steps: list[tuple[int, int, float]] = []  # (sequences decoded, audios encoded, seconds)
    runner = asr.engine.runner
    execute = runner.execute

    def timed(scheduler_output):
        start = time.perf_counter()
        sampled = execute(scheduler_output)
        steps.append((len(scheduler_output.scheduled), len(scheduler_output.encoder_requests),
                      time.perf_counter() - start))
        return sampled

    runner.execute = timed
    try:
        start = time.perf_counter()
        out = asr.transcribe(audios, language=[entry["language"] for entry in files])
        wall = time.perf_counter() - start
    finally:
        runner.execute = execute
    pieces = [piece for transcription in out for piece in transcription.pieces]
    return {
        "audio_seconds": sum(len(audio) for audio in audios) / 16000,
        "wall_seconds": wall,
        "steps": steps,
        "pieces": sum(not piece.is_continuation for piece in pieces),
        "continuations": sum(piece.is_continuation for piece in pieces),
        "samples": sum(piece.summary.num_attempts for piece in pieces if piece.summary),
        "texts": [transcription.text for transcription in out],
    }


def report(result: dict, files: list[dict], set_name: str) -> None:
    steps, wall = result["steps"], result["wall_seconds"]
    print(f"audio {result['audio_seconds']:.0f} s, wall {wall:.1f} s, RTFx {result['audio_seconds'] / wall:.1f}; "
          f"{result['pieces']} pieces, {result['continuations']} continuations, {result['samples']} samples decoded")
    encoder_steps = [step for step in steps if step[1]]
    print(f"steps that ran the encoder: {len(encoder_steps)} ({sum(s[1] for s in encoder_steps)} windows), "
          f"{sum(s[2] for s in encoder_steps):.1f} s ({100 * sum(s[2] for s in encoder_steps) / wall:.0f}% of wall)")
    for low, high in BUCKETS:
        chosen = [s for s in steps if not s[1] and low <= s[0] <= high]
        if chosen:
            seconds = sum(s[2] for s in chosen)
            label = f"{low}-{high}" if high < 1 << 30 else f"{low}+"
            print(f"  decode-only steps with {label:>6} sequences: {len(chosen):4d} steps, {seconds:5.1f} s "
                  f"({1000 * seconds / len(chosen):.0f} ms each, {100 * seconds / wall:.0f}% of wall)")
    wer = corpus_wer([entry["reference"] for entry in files], result["texts"], normalizer_for(set_name))
    print(f"pooled WER {100 * wer:.1f}%")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--set", default="real-en", choices=("real-en", "real-multi", "espeak-en", "mostly-silence"))
    parser.add_argument("--repeats", type=int, default=1)
    parser.add_argument("--dtype", default="auto", help="the engine's dtype (auto: what `asrserve serve` picks here)")
    args = parser.parse_args()
    directory = Path(tempfile.mkdtemp(prefix="asrserve-long-profile-"))
    files = build_sets([args.set], directory).get(args.set)
    if not files:
        raise SystemExit(f"{args.set} could not be built (is ../shared/audio there?)")
    asr = ASR(args.model, dtype=args.dtype)
    asr.transcribe([soundfile.read(directory / files[0]["file"], dtype="float32")[0][:16000 * 5]])  # warm-up
    for _ in range(args.repeats):
        report(profile(asr, files, directory), files, args.set)


if __name__ == "__main__":
    main()
