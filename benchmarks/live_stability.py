"""What the live stable-word rule costs in accuracy, and how early it lets text out.

    python benchmarks/live_stability.py [--model tiny.en] [--hop-s 0.5] [--rules 1.0:none,0.5:none,0.5:-1]
    python benchmarks/live_stability.py --model base --multilingual

Live transcription (entrypoints.live_decode) re-decodes a growing utterance and sends a word
once two interim decodes in a row agree on it and the word after it begins at least a margin
(STABLE_MARGIN_S) before the end of the audio decoded; sent words are the forced prefix of
every later decode, the final one included, so a word sent wrong stays wrong. This replays that
rule offline, deterministically and without real time: an interim decode every `hop` seconds of
audio (the session's 0.5 s interval, or one decode's latency where that is longer: 0.5 s with
2 bf16 cores or a GPU, ~0.5-0.9 s with 2 float32 cores), the server's own interim and final
parameters, every utterance's decode of one round batched together. For each rule
(margin:min_logprob, the confidence floor of WordBoundaries.stable_length; "none" for no
floor) it prints the WER of the live transcripts (what `completed` says) against the
references, next to the WER of one decode of the whole utterance (no interim text: what a file
upload or manual commit gives), and how much speech (from the utterance's first speech, per
Silero VAD) had been heard when its first words became stable: the time to the first delta is
that plus one decode's latency.

Utterances: the English recordings of ../shared/audio up to 30 s (one Whisper window, as a
live segment), and Harvard sentences spoken by espeak-ng four at a time (~10 s each); with
--multilingual (a multilingual model) also its German, Spanish, French, Italian and Portuguese
recordings, each decoded in its language and scored apart (Whisper's basic normaliser)."""

from __future__ import annotations

import argparse
import csv
import json
import sys
import tempfile
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asrserve import ASR
from asrserve.audio.decode import load_audio
from asrserve.audio.vad import speech_regions
from asrserve.benchmark.wer import corpus_wer, english_normalizer
from asrserve.config import N_SAMPLES, SAMPLE_RATE
from asrserve.entrypoints.live_decode import DecodeCollector, WordBoundaries, final_params, interim_params
from benchmarks.workloads import HARVARD, SHARED_AUDIO, speak

MIN_INTERIM_S = 0.5  # the session's first interim decode waits for this much audio


def utterances(directory: Path, espeak_count: int, multilingual: bool) -> list[tuple[str, np.ndarray, str, str]]:
    """(name, 16 kHz audio, reference, language) for every utterance."""
    out = []
    manifest = SHARED_AUDIO / "manifest.tsv"
    if manifest.is_file():
        with open(manifest, encoding="utf-8") as file:
            for row in csv.DictReader(file, delimiter="\t"):
                wanted = row["language"] == "en" or multilingual
                if wanted and float(row["duration_seconds"]) <= 30 and "[" not in row["reference_transcript"]:
                    out.append((row["file"], load_audio(SHARED_AUDIO / row["file"]), row["reference_transcript"],
                                row["language"]))
    for index in range(espeak_count):
        text = " ".join(HARVARD[(4 * index + k) % len(HARVARD)] for k in range(4))
        path = directory / f"espeak{index}.wav"
        speak(text, path)
        out.append((path.name, load_audio(path)[:N_SAMPLES], text, "en"))
    return out


def run_round(asr: ASR, requests: dict[str, tuple[np.ndarray, list[int], object, str]]) -> dict:
    """Decodes every (audio, prefix, params, language) at once; request id -> LiveDecode."""
    engine = asr.engine
    collectors = {}
    for request_id, (audio, prefix, params, language) in requests.items():
        engine.add_request(request_id, audio, language, "transcribe", params, None, prefix, interactive=True)
        collectors[request_id] = DecodeCollector(language)
    while engine.has_work():
        for output in engine.step():
            collectors[output.request_id].add(output)
    return {request_id: collector.result(asr.tokenizer) for request_id, collector in collectors.items()}


def replay(asr: ASR, items: list[tuple[str, np.ndarray, str, str]], hop_s: float, margin: float | None,
           min_logprob: float | None) -> dict:
    """The live rule over every utterance (margin None: no interim decodes at all)."""
    words = WordBoundaries(asr.tokenizer)
    stable: list[list[int]] = [[] for _ in items]
    stable_logprobs: list[list[float]] = [[] for _ in items]
    previous: list[list[int] | None] = [None for _ in items]
    first_stable_at: list[float | None] = [None for _ in items]
    position = MIN_INTERIM_S
    while margin is not None and any(position * SAMPLE_RATE < len(item[1]) for item in items):
        end = int(position * SAMPLE_RATE)
        live = [i for i, item in enumerate(items) if end < len(item[1])]
        tag = f"m{margin}-l{min_logprob}"
        results = run_round(asr, {f"{tag}-i{i}-{end}": (items[i][1][:end], stable[i], interim_params(), items[i][3])
                                 for i in live})
        for i in live:
            result = results[f"{tag}-i{i}-{end}"]
            if result.no_speech:
                previous[i] = None
                continue
            current = stable[i] + result.token_ids
            logprobs = stable_logprobs[i] + result.logprobs
            if previous[i] is not None:
                times = None if result.token_times is None else [0.0] * len(stable[i]) + result.token_times
                keep = words.stable_length(previous[i], current, len(stable[i]), items[i][3], times, position - margin,
                                           logprobs, min_logprob)
                if keep > len(stable[i]):
                    stable[i], stable_logprobs[i] = current[:keep], logprobs[:keep]
                    if first_stable_at[i] is None:
                        first_stable_at[i] = position
            previous[i] = current
        position += hop_s
    finals = run_round(asr, {f"m{margin}-l{min_logprob}-f{i}": (item[1], stable[i], final_params(bool(stable[i])), item[3])
                             for i, item in enumerate(items)})
    texts = [asr.tokenizer.decode(stable[i] + finals[f"m{margin}-l{min_logprob}-f{i}"].token_ids).strip()
             for i in range(len(items))]
    onsets = [speech_onset(item[1]) for item in items]
    heard = [at - onset for at, onset in zip(first_stable_at, onsets) if at is not None]
    return {
        "margin_s": margin, "min_logprob": min_logprob, "hop_s": hop_s,
        **wer_by_language(items, texts),
        "utterances_with_interim_text": len(heard),
        "speech_heard_before_first_words_s": {
            "p50": round(float(np.median(heard)), 2) if heard else None, "max": round(max(heard), 2) if heard else None,
        },
        "words_sent_before_the_end": round(sum(len(asr.tokenizer.decode(s).split()) for s in stable)
                                           / max(1, sum(len(t.split()) for t in texts)), 3),
        "transcripts": texts,
    }


def wer_by_language(items: list[tuple[str, np.ndarray, str, str]], texts: list[str]) -> dict:
    """"wer": English (Whisper's English normaliser); "wer_other": every other language pooled."""
    from whisper_normalizer.basic import BasicTextNormalizer

    out = {}
    for key, english, normalizer in (("wer", True, english_normalizer()), ("wer_other", False, BasicTextNormalizer())):
        chosen = [i for i, item in enumerate(items) if (item[3] == "en") == english]
        if chosen:
            out[key] = round(corpus_wer([items[i][2] for i in chosen], [texts[i] for i in chosen], normalizer), 4)
    return out


def speech_onset(audio: np.ndarray) -> float:
    regions = speech_regions(audio)
    return regions[0][0] / SAMPLE_RATE if regions else 0.0


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="tiny.en")
    parser.add_argument("--dtype", default="auto")
    parser.add_argument("--hop-s", type=float, default=0.5)
    parser.add_argument("--rules", default="1.0:none,0.5:none,0.5:-1",
                        help="margin:min_logprob, comma-separated; 'none': no confidence floor")
    parser.add_argument("--espeak", type=int, default=8, help="espeak-ng utterances of four sentences")
    parser.add_argument("--multilingual", action="store_true", help="also the non-English recordings")
    parser.add_argument("--save-result", type=Path, default=None)
    args = parser.parse_args()
    asr = ASR(args.model, dtype=args.dtype)
    with tempfile.TemporaryDirectory() as directory:
        items = utterances(Path(directory), args.espeak, args.multilingual)
    print(f"{len(items)} utterances, {sum(len(item[1]) for item in items) / SAMPLE_RATE:.1f} s; {args.model}, "
          f"{str(asr.engine.runner.dtype).removeprefix('torch.')}; an interim decode every {args.hop_s} s of audio")
    rows = []
    rules = [(float(m), None if f == "none" else float(f)) for m, f in (r.split(":") for r in args.rules.split(","))]
    for margin, min_logprob in [(None, None)] + rules:
        row = replay(asr, items, args.hop_s, margin, min_logprob)
        rows.append(row)
        label = "no interim text" if margin is None else f"margin {margin:g} s, floor {min_logprob}"
        heard = row["speech_heard_before_first_words_s"]
        other = f" (other languages {row['wer_other'] * 100:.1f} %)" if "wer_other" in row else ""
        print(f"{label:>28}: WER {row['wer'] * 100:.1f} %{other}; first words stable after {heard['p50']} s of speech "
              f"(p50, max {heard['max']}) on {row['utterances_with_interim_text']} utterances; "
              f"{row['words_sent_before_the_end'] * 100:.0f} % of words sent during speech", flush=True)
    if args.save_result:
        args.save_result.write_text(json.dumps({"model": args.model, "utterances": [item[0] for item in items],
                                                "rows": rows}, indent=1) + "\n")


if __name__ == "__main__":
    main()
