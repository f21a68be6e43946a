"""How the default VAD cut is tuned, measured on benchmarks/long_form.py's sets: the padding
kept around speech, and whether a long pause should end a piece early.

    python benchmarks/vad_cut_choices.py --model base --prefix-padding-ms 300,500,750,1000,2000
    python benchmarks/vad_cut_choices.py --model base --max-gap-s none,3,6

Every configuration runs offline `ASR(model).transcribe` over all files of a set at once with
OpenAI's defaults (temperature fallback on, plain text), the language given, and prints pooled
WER, the worst file's and each file's WER (the sets' own normalisers) and RTFx.

--prefix-padding-ms: the server_vad strategy's padding on each side of a speech region
(asrserve's default 300 ms, OpenAI's). --max-gap-s: a piece also ends where the pause before
the next speech region is at least this long, so that speech on either side of a long pause is
decoded in separate windows (none: pieces fill up to 30 s whatever the pauses, the default).
"""

from __future__ import annotations

import argparse
import math
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import soundfile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import asrserve.audio.vad as vad
from asrserve import ASR
from asrserve.audio.chunking import AudioPiece, ChunkingStrategy
from asrserve.config import N_SAMPLES, SAMPLE_RATE
from benchmarks.long_form import build_sets, normalizer_for, score


def pieces_ending_at_long_pauses(max_gap_s: float):
    """vad_pieces, except that a piece is not extended over a pause of max_gap_s or more."""
    max_gap = max_gap_s * SAMPLE_RATE

    def cut(samples, threshold=vad.DEFAULT_THRESHOLD, prefix_padding_ms=vad.DEFAULT_PREFIX_PADDING_MS,
            silence_duration_ms=vad.DEFAULT_SILENCE_DURATION_MS, max_samples=N_SAMPLES,
            min_speech_ms=vad.DEFAULT_MIN_SPEECH_MS, *, probs=None):
        samples = np.asarray(samples, dtype=np.float32)
        probs = vad.speech_probabilities(samples) if probs is None else np.asarray(probs)
        pad = math.ceil(SAMPLE_RATE * prefix_padding_ms / 1000) + 1
        raw = vad._raw_regions(probs, len(samples), threshold, silence_duration_ms, min_speech_ms)
        raw = [part for s, e in raw for part in vad._split_long(s, e, probs, samples, max_samples - 2 * pad)]
        spans: list[list[int]] = []  # [start, end, end of the speech in it]
        for (start, end), (speech_start, speech_end) in zip(vad._pad(raw, len(samples), prefix_padding_ms), raw):
            if spans and end - spans[-1][0] <= max_samples and speech_start - spans[-1][2] < max_gap:
                spans[-1][1:] = [end, speech_end]
            else:
                spans.append([start, end, speech_end])
        return [AudioPiece(start, samples[start:end]) for start, end, _ in spans if end > start]

    return cut


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="base")
    parser.add_argument("--sets", default=None, help="default: real-en,espeak-en,mostly-silence (+ real-multi on base)")
    parser.add_argument("--prefix-padding-ms", default="300")
    parser.add_argument("--max-gap-s", default="none")
    args = parser.parse_args()
    names = args.sets.split(",") if args.sets else (
        ["real-en", "espeak-en", "mostly-silence"] + (["real-multi"] if args.model != "tiny.en" else []))
    directory = Path(tempfile.mkdtemp(prefix="vad-cut-"))
    sets = build_sets(names, directory)
    asr = ASR(args.model)
    default_cut = vad.vad_pieces
    for gap in [None if g == "none" else float(g) for g in args.max_gap_s.split(",")]:
        vad.vad_pieces = default_cut if gap is None else pieces_ending_at_long_pauses(gap)
        for padding in [int(p) for p in args.prefix_padding_ms.split(",")]:
            strategy = ChunkingStrategy("server_vad", prefix_padding_ms=padding)
            for name, files in sets.items():
                audios = [soundfile.read(directory / f["file"], dtype="float32")[0] for f in files]
                began = time.perf_counter()
                out = asr.transcribe(audios, language=[f["language"] for f in files], chunking_strategy=strategy)
                wall = time.perf_counter() - began
                result = score(files, [o.text for o in out], normalizer_for(name))
                seconds = sum(f["seconds"] for f in files)
                per_file = " ".join(f"{100 * row['wer']:.1f}" for row in result["per_file"])
                print(f"{args.model} padding {padding} ms, max gap {gap} s, {name}: WER {100 * result['wer']:.1f} "
                      f"(worst {100 * result['worst_wer']:.1f}; per file {per_file}), RTFx {seconds / wall:.1f}",
                      flush=True)


if __name__ == "__main__":
    main()
