"""What timestamps, word timestamps and temperature fallback cost: the English recordings of
../shared/audio (about 108 s of real speech, 7 files) through asrserve's offline engine in
each decoding mode, same model and settings.

    python benchmarks/decoding_features.py [--model tiny.en] [--dtype float32] [--repeats 3]

RTFx = seconds of audio / wall seconds for the whole set (median of --repeats passes after a
warm-up); WER against the reference transcripts (lower-cased, punctuation dropped); "retried"
counts pieces whose greedy decode failed Whisper's checks and was decoded again.
"""

from __future__ import annotations

import argparse
import csv
import platform
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asrserve import ASR
from asrserve.audio.decode import load_audio
from tests.wer import corpus_wer

SHARED_AUDIO = Path(__file__).resolve().parents[2] / "shared" / "audio"
MODES = {
    "text, decode once": dict(fallback=False),
    "text, fallback (default)": dict(),
    "segments (verbose_json/srt/vtt)": dict(timestamps=True),
    "segments + words": dict(word_timestamps=True),
}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default=None, help="default: the bundled tiny.en")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    manifest = SHARED_AUDIO / "manifest.tsv"
    if not manifest.is_file():
        sys.exit(f"{manifest} is missing: this benchmark needs ../shared/audio")
    rows = [r for r in csv.reader(manifest.open(), delimiter="\t")][1:]
    rows = [r for r in rows if r[4] == "en"]
    audios = [load_audio(SHARED_AUDIO / r[0]) for r in rows]
    references = [r[7] for r in rows]
    audio_seconds = sum(len(a) for a in audios) / 16000

    asr = ASR(args.model, dtype=args.dtype)
    print(f"{len(audios)} files, {audio_seconds:.1f} s of audio, {asr.engine.model_name} {args.dtype}, "
          f"{torch.get_num_threads()} threads, {platform.processor() or platform.machine()}")
    print(f"{'mode':34} {'wall s':>8} {'RTFx':>7} {'WER %':>7} {'retried':>8}")
    asr.transcribe(audios[:2])  # warm-up
    for name, options in MODES.items():
        walls = []
        for _ in range(args.repeats):
            start = time.perf_counter()
            results = asr.transcribe(audios, **options)
            walls.append(time.perf_counter() - start)
        wall = statistics.median(walls)
        retried = sum(p.summary.num_attempts > 1 for r in results for p in r.pieces)
        wer = corpus_wer(references, [r.text for r in results])
        print(f"{name:34} {wall:8.2f} {audio_seconds / wall:7.1f} {100 * wer:7.1f} {retried:8d}")


if __name__ == "__main__":
    main()
