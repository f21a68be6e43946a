"""Music before, after and without speech: is speech read once, and is nothing written over the music?

    python benchmarks/music_around_speech.py [--model tiny.en] [--save-result music_around_speech.json]

Every English recording of ../shared/audio of 15 s or less (the file stays one piece of 30 s or
less) is put after 12 s of music and before 15 s of music (asrserve.benchmark.synthetic_music:
chords under drums, 6 dB below the recording's RMS), and 20 s of music alone is added in 4
variants. Each file is transcribed offline with OpenAI's defaults for verbose_json (timestamps:
seek continuation decides there; json decodes once without them). Reported per case: WER
against the references (Whisper's English normaliser), files whose text holds a recording's
reference twice or more, words written beyond the reference's count (over the music), and for
music before speech the first segment's start against where the speech starts (median, worst);
for music alone, the words written.
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
from asrserve.benchmark.synthetic_music import music  # noqa: E402
from asrserve.benchmark.wer import english_normalizer, word_errors  # noqa: E402

SAMPLE_RATE = 16000
MAX_RECORDING_S = 15.0
BEFORE_S, AFTER_S, ALONE_S = 12, 15, 20


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--save-result")
    args = parser.parse_args()
    recordings = short_english_recordings(MAX_RECORDING_S)
    from asrserve.entrypoints.offline import ASR

    asr = ASR(args.model)
    normalize = english_normalizer()
    rows = []
    for case in ("music before", "music after"):
        files, starts = [], []
        for index, piece in enumerate(recordings):
            level = 20 * np.log10(np.sqrt(np.mean(piece.samples.astype(np.float64) ** 2)) + 1e-9) - 6
            backing = music(BEFORE_S if case == "music before" else AFTER_S, seed=index, level_db=level)
            parts = [backing, piece.samples] if case == "music before" else [piece.samples, backing]
            files.append(np.concatenate(parts).astype(np.float32))
            lead = BEFORE_S if case == "music before" else 0
            starts.append(lead + (first_sound(piece.samples, piece.samples) or 0) / SAMPLE_RATE)
        results = asr.transcribe(files, timestamps=True)
        errors = words = twice = extra = 0
        start_errors = []
        for result, piece, start in zip(results, recordings, starts):
            reference, hypothesis = normalize(piece.text).split(), normalize(result.text).split()
            errors += word_errors(reference, hypothesis)
            words += len(reference)
            twice += len(hypothesis) >= 1.8 * len(reference)
            extra += max(0, len(hypothesis) - len(reference))
            if case == "music before" and result.segments:
                start_errors.append(abs(result.segments[0].start - start))
        row = {"case": case, "files": len(files), "wer": round(100 * errors / words, 2), "read_twice": int(twice),
               "words_beyond_reference": int(extra)}
        if start_errors:
            row["first_segment_start_error_s"] = {"median": round(float(np.median(start_errors)), 2),
                                                  "max": round(float(np.max(start_errors)), 2)}
        rows.append(row)
        print(json.dumps(row), flush=True)
    alone = [music(ALONE_S, seed=seed, level_db=level) for seed, level in ((0, -18), (1, -30), (2, -18), (3, -30))]
    written = [len(normalize(result.text).split()) for result in asr.transcribe(alone, timestamps=True)]
    rows.append({"case": "music alone", "files": len(alone), "words_written": written})
    print(json.dumps(rows[-1]), flush=True)
    if args.save_result:
        Path(args.save_result).write_text(json.dumps({"model": args.model, "rows": rows}, indent=2) + "\n")


if __name__ == "__main__":
    main()
