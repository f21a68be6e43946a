"""asrserve's long-audio choices side by side: how audio is cut, timestamps, seek continuation.

    python benchmarks/long_form_choices.py tiny.en notimestamps energy energy-noseek auto sequential

Three files joined from the seven English recordings of ../shared/audio with 0.3-0.8 s pauses
(seeded): two of ~112 s starting the cycle at different recordings, one of ~224 s that runs
the cycle forwards then backwards. Offline `ASR.transcribe` in float32 with OpenAI's defaults
(temperature fallback on, plain text). Prints pooled and per-file WER (Whisper's English
normaliser) and wall seconds (all files submitted at once).

Configurations:
  energy / auto            cut at quiet points / at voice activity; timestamps, seek continuation
  energy-noseek / auto-noseek   the same, one decode per piece
  notimestamps             cut at quiet points, no timestamp tokens (asrserve before issue 15)
  sequential               VAD pieces decoded one after another, each conditioned on the text
                           of the pieces before it (openai/whisper's condition_on_previous_text)
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asrserve import ASR
from asrserve.audio.chunking import ChunkingStrategy, cut_audio
from asrserve.benchmark.wer import corpus_wer, english_normalizer
from asrserve.config import SAMPLE_RATE
from asrserve.entrypoints import offline
from benchmarks.workloads import english_recordings


def development_set() -> list[tuple[np.ndarray, str]]:
    recordings = english_recordings()
    if not recordings:
        sys.exit("../shared/audio is not here")
    rng = np.random.default_rng(0)
    files = []
    for start in range(3):
        order = recordings[start:] + recordings[:start]
        if start == 2:
            order = order + order[::-1]
        audio, texts = [], []
        for samples, text in order:
            audio += [samples, np.zeros(int(SAMPLE_RATE * rng.uniform(0.3, 0.8)), np.float32)]
            texts.append(text)
        files.append((np.concatenate(audio), " ".join(texts)))
    return files


def transcribe(asr: ASR, audios: list[np.ndarray], config: str, language: str | None) -> list[str]:
    if config == "sequential":
        texts = []
        for audio in audios:
            previous: list[str] = []
            for piece in cut_audio(audio, ChunkingStrategy("server_vad")):
                prompt = " ".join(previous)[-800:] or None
                result = asr.transcribe(piece.samples, language=language, prompt=prompt, timestamps=True)[0]
                previous.append(result.text.strip())
            texts.append(" ".join(previous))
        return texts
    strategy = "server_vad" if config.startswith("auto") else "energy"
    seek = not config.endswith("-noseek")
    long_form_params = offline.long_form_params
    if config == "notimestamps":
        offline.long_form_params = lambda params, duration: params
    try:
        results = asr.transcribe(audios, language=language, chunking_strategy=strategy, seek_continuation=seek)
    finally:
        offline.long_form_params = long_form_params
    return [result.text for result in results]


def main() -> None:
    model, configs = sys.argv[1], sys.argv[2:]
    files = development_set()
    normalize = english_normalizer()
    references = [text for _, text in files]
    asr = ASR(model, dtype="float32")
    language = None if model.endswith(".en") else "en"
    for config in configs:
        start = time.monotonic()
        hypotheses = transcribe(asr, [audio for audio, _ in files], config, language)
        wall = time.monotonic() - start
        per_file = [corpus_wer([r], [h], normalize) * 100 for r, h in zip(references, hypotheses)]
        pooled = corpus_wer(references, hypotheses, normalize) * 100
        print(f"{model} {config}: WER {pooled:.1f} (files: {' '.join(f'{w:.1f}' for w in per_file)}) {wall:.1f} s",
              flush=True)


if __name__ == "__main__":
    main()
