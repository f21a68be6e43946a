"""Why base trails faster-whisper on long_form.py's real-multi set: a window holding the same
sentence twice against a window holding it once.

    python benchmarks/repeated_sentence_windows.py [--seeds 3]

real-multi's files are one recorded sentence (de, es, fr, it, pt from ../shared/audio), said
five times 15.5-19 s apart, so every 30 s piece holds two copies. Here each sentence is decoded
alone, and twice in one clip with a pause of 0.5-12 s of faint noise between the copies (one
clip of up to 30 s: one window). base, float32, timestamps on (as long-audio pieces decode),
OpenAI's defaults otherwise, the language given; every clip in one `transcribe` call per seed.
Prints pooled WER (Whisper's basic normaliser) by pause, over all languages and seeds.
"""

from __future__ import annotations

import argparse
import csv
import sys
import tempfile
from pathlib import Path

import numpy as np
import soundfile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asrserve import ASR
from asrserve.audio.decode import load_audio
from asrserve.benchmark.wer import corpus_wer
from asrserve.config import N_SAMPLES, SAMPLE_RATE
from benchmarks.workloads import SHARED_AUDIO

PAUSES_S = (0.5, 1, 2, 4, 6, 8, 12)


def clips(directory: Path) -> list[tuple[str, str, Path, str]]:
    """(language, pause label, wav path, reference) for every clip that fits one window."""
    rng = np.random.default_rng(0)
    out = []
    with open(SHARED_AUDIO / "manifest.tsv", encoding="utf-8") as file:
        rows = [row for row in csv.DictReader(file, delimiter="\t") if row["language"] != "en"]
    for row in rows:
        language, reference = row["language"], row["reference_transcript"]
        sentence = load_audio(SHARED_AUDIO / row["file"])
        variants = [("alone", sentence, reference)]
        for pause in PAUSES_S:
            noise = (rng.normal(0, 1, int(SAMPLE_RATE * pause)) * 1e-4).astype(np.float32)
            audio = np.concatenate([sentence, noise, sentence])
            if len(audio) <= N_SAMPLES:
                variants.append((f"{pause:g} s", audio, f"{reference} {reference}"))
        for label, audio, text in variants:
            path = directory / f"{language}-{label.replace(' ', '')}.wav"
            soundfile.write(path, audio, SAMPLE_RATE)
            out.append((language, label, path, text))
    return out


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seeds", type=int, default=3)
    args = parser.parse_args()
    if not (SHARED_AUDIO / "manifest.tsv").is_file():
        sys.exit("../shared/audio is not here")
    from whisper_normalizer.basic import BasicTextNormalizer

    normalize = BasicTextNormalizer()
    asr = ASR("base", dtype="float32")
    with tempfile.TemporaryDirectory() as tmp:
        items = clips(Path(tmp))
        by_label: dict[str, tuple[list[str], list[str]]] = {}
        for seed in range(args.seeds):
            results = asr.transcribe([str(path) for _, _, path, _ in items], language=[lang for lang, *_ in items],
                                     seed=seed, timestamps=True)
            for (_, label, _, reference), result in zip(items, results):
                references, hypotheses = by_label.setdefault(label, ([], []))
                references.append(reference)
                hypotheses.append(result.text)
    print("window holds           WER %")
    for label, (references, hypotheses) in by_label.items():
        what = "the sentence once" if label == "alone" else f"it twice, {label} apart"
        print(f"{what:<22} {100 * corpus_wer(references, hypotheses, normalize):6.1f}")


if __name__ == "__main__":
    main()
