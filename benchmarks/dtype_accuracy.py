"""Does the CPU fast path (bfloat16, compiled encoder) keep float32's accuracy? WER of both on
every English set the benchmarks use, pooled, with Whisper's decoding defaults (temperature
fallback on), for tiny.en and base:

    python benchmarks/dtype_accuracy.py [--models tiny.en,base]

Sets: the English recordings of ../shared/audio (real speech, text mode), 32 Harvard sentences
spoken by espeak-ng (text mode), and two ~112 s recordings joined from the real ones
(timestamps, Whisper's long-form mode). WER with Whisper's English normaliser.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asrserve import ASR
from asrserve.benchmark.wer import english_normalizer, word_errors
from benchmarks.workloads import english_recordings, long_recordings, short_clips


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny.en,base")
    args = parser.parse_args()
    normalize = english_normalizer()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        recordings = english_recordings()
        sets = {"real speech": ([a for a, _ in recordings], [t for _, t in recordings], False)}
        clips = short_clips(32, directory)
        sets["Harvard clips"] = ([directory / name for name in clips], list(clips.values()), False)
        longs = long_recordings(2, 90, directory)
        sets["long, timestamps"] = ([directory / name for name in longs], list(longs.values()), True)
        print(f"{'model':<9}{'dtype':<10}" + "".join(f"{name:>20}" for name in sets) + f"{'pooled':>10}")
        for model in args.models.split(","):
            for dtype in ("float32", "auto"):
                asr = ASR(model, dtype=dtype)
                errors = words = 0
                cells = []
                for audios, references, timestamps in sets.values():
                    texts = [r.text for r in asr.transcribe(audios, timestamps=timestamps, language="en")]
                    e = sum(word_errors(normalize(r).split(), normalize(h).split()) for r, h in zip(references, texts))
                    n = sum(len(normalize(r).split()) for r in references)
                    cells.append(f"{100 * e / n:>12.2f} ({e:>3}/{n})")
                    errors, words = errors + e, words + n
                label = str(asr.engine.dtype).removeprefix("torch.")
                print(f"{model:<9}{label:<10}" + "".join(f"{c:>20}" for c in cells) + f"{100 * errors / words:>10.2f}",
                      flush=True)


if __name__ == "__main__":
    main()
