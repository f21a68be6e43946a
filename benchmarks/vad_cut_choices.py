"""How the default VAD cut is tuned, measured on benchmarks/long_form.py's sets: the padding
kept around speech, whether a long pause should end a piece early, and where a full piece ends.

    python benchmarks/vad_cut_choices.py --model base --prefix-padding-ms 300,500,750,1000,2000
    python benchmarks/vad_cut_choices.py --model base --max-gap-s none,3,6
    python benchmarks/vad_cut_choices.py --model tiny.en --sets real-en,espeak-en --lookback-s none,5,7.5,10,15 \
        --longer-by 1 --layout-seeds 0,1,2,3,4

Every configuration runs offline `ASR(model).transcribe` over all files of a set at once with
OpenAI's defaults (temperature fallback on, plain text), the language given, and prints pooled
WER, the worst file's and each file's WER (the sets' own normalisers) and RTFx.

--prefix-padding-ms: the server_vad strategy's padding on each side of a speech region
(asrserve's default 300 ms, OpenAI's). --max-gap-s: a piece also ends where the pause before
the next speech region is at least this long, so that speech on either side of a long pause is
decoded in separate windows (none: pieces fill up to 30 s whatever the pauses, the default).
--lookback-s: a piece the next speech region would overfill ends at the longest pause of its
last this many seconds (10, the default) if that pause is --longer-by times as long as its last
(2, the default; 1: any longer pause) or, with none, at its last pause. --layout-seeds: each
set laid out anew (benchmarks/long_form.py's --layout-seed) once per seed.
"""

from __future__ import annotations

import argparse
import sys
import tempfile
import time
from pathlib import Path

import soundfile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asrserve.audio.piece_cutter as piece_cutter
import asrserve.audio.vad_regions as vad_regions
from asrserve import ASR
from asrserve.audio.chunking import ChunkingStrategy
from benchmarks.long_form import build_sets, normalizer_for, score


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="base")
    parser.add_argument("--sets", default=None, help="default: real-en,espeak-en,mostly-silence (+ real-multi on base)")
    parser.add_argument("--prefix-padding-ms", default="300")
    parser.add_argument("--max-gap-s", default="none")
    parser.add_argument("--lookback-s", default="10")
    parser.add_argument("--longer-by", default="2")
    parser.add_argument("--layout-seeds", default="0", help="benchmarks/long_form.py's --layout-seed, several")
    args = parser.parse_args()
    names = args.sets.split(",") if args.sets else (
        ["real-en", "espeak-en", "mostly-silence"] + (["real-multi"] if args.model != "tiny.en" else []))
    directory = Path(tempfile.mkdtemp(prefix="vad-cut-"))
    seeds = [int(seed) for seed in args.layout_seeds.split(",")]
    sets = {(seed, name): files
            for seed in seeds for name, files in build_sets(names, directory / str(seed), seed).items()}
    asr = ASR(args.model)
    choices = [(None if g == "none" else float(g), None if b == "none" else float(b), float(by))
               for g in args.max_gap_s.split(",") for b in args.lookback_s.split(",")
               for by in args.longer_by.split(",")]
    for gap, lookback, longer_by in choices:
        vad_regions.LONGER_BY = longer_by
        piece_cutter.MAX_GAP_MS = None if gap is None else 1000 * gap  # what cut_audio uses
        piece_cutter.LOOKBACK_MS = None if lookback is None else 1000 * lookback
        for padding in [int(p) for p in args.prefix_padding_ms.split(",")]:
            strategy = ChunkingStrategy("server_vad", prefix_padding_ms=padding)
            for (seed, name), files in sets.items():
                audios = [soundfile.read(directory / str(seed) / f["file"], dtype="float32")[0] for f in files]
                began = time.perf_counter()
                out = asr.transcribe(audios, language=[f["language"] for f in files], chunking_strategy=strategy)
                wall = time.perf_counter() - began
                result = score(files, [o.text for o in out], normalizer_for(name))
                seconds = sum(f["seconds"] for f in files)
                per_file = " ".join(f"{100 * row['wer']:.1f}" for row in result["per_file"])
                print(f"{args.model} padding {padding} ms, max gap {gap} s, lookback {lookback} s longer by {longer_by}, "
                      f"{name} "
                      f"(layout {seed}): WER {100 * result['wer']:.1f} (worst {100 * result['worst_wer']:.1f}; "
                      f"per file {per_file}), RTFx {seconds / wall:.1f}",
                      flush=True)


if __name__ == "__main__":
    main()
