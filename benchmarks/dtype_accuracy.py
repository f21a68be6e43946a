"""Does the fast path (bfloat16, compiled encoder) keep float32's accuracy? WER of both on every
English set the benchmarks use, pooled, with Whisper's decoding defaults (temperature fallback
on), for tiny.en and base:

    python benchmarks/dtype_accuracy.py [--models tiny.en,base] [--device cuda]

Sets: the English recordings of ../shared/audio (real speech, text mode), 32 Harvard sentences
spoken by espeak-ng (text mode), and two ~112 s recordings joined from the real ones
(timestamps, Whisper's long-form mode). WER with Whisper's English normaliser.

A machine without espeak-ng or ../shared/audio (a bare GPU machine) reads the sets written
here beforehand: `--write-sets DIR` here, `--sets DIR` there (the audio bit for bit the same).
"""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
from pathlib import Path

import soundfile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asrserve import ASR
from asrserve.benchmark.wer import english_normalizer, word_errors
from asrserve.config import SAMPLE_RATE
from benchmarks.workloads import english_recordings, long_recordings, short_clips, write_manifest

# set name -> (folder under --sets, decoded with timestamps: Whisper's long-form mode)
SETS = {"real speech": ("real", False), "Harvard clips": ("harvard", False), "long, timestamps": ("long", True)}


def write_sets(directory: Path) -> None:
    """Each set as audio files and a manifest.tsv in its folder under `directory`: the real
    recordings as float32 WAV at 16 kHz (the decoded samples themselves), the others as FLAC."""
    folders = {name: directory / folder for name, (folder, _) in SETS.items()}
    for folder in folders.values():
        folder.mkdir(parents=True, exist_ok=True)
    real = {}
    for index, (audio, text) in enumerate(english_recordings()):
        real[f"real{index}.wav"] = text
        soundfile.write(folders["real speech"] / f"real{index}.wav", audio, SAMPLE_RATE, subtype="FLOAT")
    write_manifest(folders["real speech"], real)
    makers = {"Harvard clips": lambda d: short_clips(32, d), "long, timestamps": lambda d: long_recordings(2, 90, d)}
    for name, make in makers.items():
        # 16-bit WAV files: as FLAC, the same samples in half the bytes
        references = {}
        for file, text in make(folders[name]).items():
            path = folders[name] / file
            samples, rate = soundfile.read(path, dtype="int16")
            soundfile.write(path.with_suffix(".flac"), samples, rate)
            path.unlink()
            references[Path(file).with_suffix(".flac").name] = text
        write_manifest(folders[name], references)


def read_sets(directory: Path) -> dict[str, tuple[list[Path], list[str], bool]]:
    """Set name -> (audio files, reference texts, timestamps)."""
    sets = {}
    for name, (folder, timestamps) in SETS.items():
        with open(directory / folder / "manifest.tsv", encoding="utf-8") as file:
            rows = list(csv.DictReader(file, delimiter="\t"))
        if rows:
            sets[name] = ([directory / folder / row["file"] for row in rows], [row["text"] for row in rows], timestamps)
    return sets


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny.en,base", help="model names or checkpoint folders, comma-separated")
    parser.add_argument("--dtypes", default="float32,auto")
    parser.add_argument("--device", default="auto")
    parser.add_argument("--sets", type=Path, default=None, help="read the sets written by --write-sets")
    parser.add_argument("--write-sets", type=Path, default=None, help="write the sets to this folder and stop")
    parser.add_argument("--out", type=Path, default=None, help="also write the table as JSON")
    args = parser.parse_args()
    if args.write_sets:
        write_sets(args.write_sets)
        return
    normalize = english_normalizer()
    rows = []
    with tempfile.TemporaryDirectory() as tmp:
        directory = args.sets
        if directory is None:
            directory = Path(tmp)
            write_sets(directory)
        sets = read_sets(directory)
        print(f"{'model':<9}{'dtype':<10}" + "".join(f"{name:>20}" for name in sets) + f"{'pooled':>10}")
        for model in args.models.split(","):
            for dtype in args.dtypes.split(","):
                asr = ASR(model, dtype=dtype, device=args.device)
                errors = words = 0
                cells, row = [], {"model": model, "device": str(asr.engine.device), "sets": {}}
                for name, (audios, references, timestamps) in sets.items():
                    texts = [r.text for r in asr.transcribe(audios, timestamps=timestamps, language="en")]
                    e = sum(word_errors(normalize(r).split(), normalize(h).split()) for r, h in zip(references, texts))
                    n = sum(len(normalize(r).split()) for r in references)
                    cells.append(f"{100 * e / n:>12.2f} ({e:>3}/{n})")
                    row["sets"][name] = {"errors": e, "words": n, "wer": round(100 * e / n, 2)}
                    errors, words = errors + e, words + n
                row["dtype"] = label = str(asr.engine.dtype).removeprefix("torch.")
                row["pooled_wer"] = round(100 * errors / words, 2)
                rows.append(row)
                print(f"{Path(model).name:<9}{label:<10}" + "".join(f"{c:>20}" for c in cells)
                      + f"{100 * errors / words:>10.2f}", flush=True)
                del asr
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
