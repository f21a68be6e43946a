"""Short recordings that open on a pause: are they read once, and timed where the speech is?

    python benchmarks/leading_pause.py [--model tiny.en] [--leads 0,3,6,12,20]
        [--save-result leading_pause.json]

Every English recording of ../shared/audio of 25 s or less (room for the pause: the file stays
one piece of 30 s or less) gets each lead-in of --leads seconds in front of it, twice: digital
zeros, and low noise (Gaussian, -60 dBFS RMS). Each file is transcribed offline with OpenAI's
defaults for verbose_json and word timestamps (`ASR(model).transcribe(..., word_timestamps=True)`).
Reported per lead-in, pooled over recordings and both kinds of pause: WER against the
references (Whisper's English normaliser), the files whose text holds a recording's reference
twice or more (a sentence read twice), and the first segment's and first word's start against
where the speech starts (the lead-in plus the recording's own first sound): median and worst
absolute error in seconds.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT / "benchmarks"))

from long_form import short_english_recordings  # noqa: E402

from asrserve.audio.chunking import first_sound  # noqa: E402
from asrserve.benchmark.wer import english_normalizer, word_errors  # noqa: E402

SAMPLE_RATE = 16000
MAX_RECORDING_S = 25.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--leads", default="0,3,6,12,20", help="lead-in pauses in seconds, comma-separated")
    parser.add_argument("--save-result")
    args = parser.parse_args()
    recordings = short_english_recordings(MAX_RECORDING_S)
    from asrserve.entrypoints.offline import ASR

    asr = ASR(args.model)
    normalize = english_normalizer()
    rng = np.random.default_rng(0)
    rows = []
    for lead_s in (float(value) for value in args.leads.split(",")):
        files, truths = [], []
        for piece in recordings:
            speech_starts = lead_s + (first_sound(piece.samples, piece.samples) or 0) / SAMPLE_RATE
            quiet = {"zeros": np.zeros(int(lead_s * SAMPLE_RATE), np.float32),
                     "noise": (0.001 * rng.standard_normal(int(lead_s * SAMPLE_RATE))).astype(np.float32)}
            for kind, pause in quiet.items():
                audio = np.concatenate([pause, piece.samples]).astype(np.float32)
                files.append(audio)
                truths.append((piece, kind, speech_starts))
        results = asr.transcribe(files, word_timestamps=True)
        errors = words = twice = 0
        segment_errors, word_errors_s = [], []
        for result, (piece, kind, speech_starts) in zip(results, truths):
            reference, hypothesis = normalize(piece.text).split(), normalize(result.text).split()
            errors += word_errors(reference, hypothesis)
            words += len(reference)
            twice += len(hypothesis) >= 1.8 * len(reference)
            if result.segments:
                segment_errors.append(abs(result.segments[0].start - speech_starts))
            if result.words:
                word_errors_s.append(abs(result.words[0].start - speech_starts))
        row = {
            "lead_s": lead_s, "files": len(files), "wer": round(100 * errors / words, 2), "read_twice": int(twice),
            "segment_start_error_s": _spread(segment_errors), "word_start_error_s": _spread(word_errors_s),
        }
        rows.append(row)
        print(json.dumps(row), flush=True)
    if args.save_result:
        Path(args.save_result).write_text(json.dumps({"model": args.model, "rows": rows}, indent=2) + "\n")


def _spread(values: list[float]) -> dict:
    if not values:
        return {}
    return {"median": round(float(np.median(values)), 2), "max": round(float(np.max(values)), 2)}


if __name__ == "__main__":
    main()
