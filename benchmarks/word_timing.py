"""Word timestamps against known times: asrserve next to faster-whisper on the same weights.

    pip install -e '.[bench]' faster-whisper
    python benchmarks/word_timing.py [--models tiny.en,base] [--systems asrserve,faster-whisper-int8]
        [--sets espeak-words,real-en] [--save-result word_timing.json]

Sets (built at start-up, 16 kHz):
  espeak-words  files whose every word's start and end are known: Harvard sentences spoken by
                espeak-ng one word at a time (four voices), the words joined with 60-250 ms of
                room tone and the sentences with 0.5-1.0 s. The truth is where each word's
                samples rise above 2% of its peak. Two short files (~20 s, one window) and two
                long ones (~150 s: several pieces, so the times also cross piece boundaries and
                seek continuations).
  real-en       benchmarks/long_form.py's real-en files (the English recordings of ../shared/audio
                joined with short pauses): no word-level truth, but every recording's first
                speech and last speech are known, so each recording's first and last recognised
                word are scored against them (where the recognised word matches the reference).
Systems, each with its long-form defaults (temperature fallback on) and word timestamps:
  asrserve             ASR(model).transcribe(files, word_timestamps=True): VAD cut, pieces side
                       by side, seek continuation.
  asrserve-energy      the same cut at quiet points (chunking_strategy="energy").
  faster-whisper-int8  WhisperModel(int8, 2 threads).transcribe(beam_size=1, word_timestamps=True):
                       sequential 30 s windows.

Scored per matched word (the recognised word equals the reference word at the same place of a
minimum-edit alignment): |start error| and |end error| (median, 90th percentile, mean; and the
signed median, positive when the recognised time is later than the true one), the
share of words with both boundaries within 0.2 s and 0.5 s of the truth, and the share whose
recognised interval does not overlap the true one at all.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
import tempfile
from difflib import SequenceMatcher
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asrserve.audio.features import SAMPLE_RATE  # noqa: E402
from benchmarks.long_form import (  # noqa: E402
    ESPEAK_VOICES, HARVARD_MORE, espeak, faster_whisper_dir, real_en, room_tone,
)
from benchmarks.workloads import HARVARD  # noqa: E402

SETS = ["espeak-words", "real-en"]
SYSTEMS = ["asrserve", "asrserve-energy", "faster-whisper-int8"]
WORD_ONSET = 0.02  # a word's samples start and end where they rise above this share of its peak
SPEECH_ONSET = 0.02  # a recording's speech: 20 ms frames above this share of its loudest frame


def words_of(text: str) -> list[str]:
    """Lower case, punctuation dropped: how recognised and reference words are compared."""
    return [w for w in (re.sub(r"[^a-z0-9']", "", t.lower()) for t in text.split()) if w]


def trimmed(samples: np.ndarray) -> np.ndarray:
    loud = np.flatnonzero(np.abs(samples) > WORD_ONSET * np.abs(samples).max())
    return samples[loud[0]: loud[-1] + 1]


def espeak_words_file(sentences: list[str], directory: Path, rng: np.random.Generator) -> dict:
    """One file: each word spoken alone, its true [start, end] recorded."""
    audio, truth, at = [room_tone(0.5, rng)], [], 0.5
    for index, sentence in enumerate(sentences):
        voice = ESPEAK_VOICES[index % len(ESPEAK_VOICES)]
        for position, word in enumerate(sentence.split()):
            if position:
                gap = room_tone(float(rng.uniform(0.06, 0.25)), rng)
                audio.append(gap)
                at += len(gap) / SAMPLE_RATE
            samples = trimmed(espeak(word, voice, 160, directory))
            truth.append((word, at, at + len(samples) / SAMPLE_RATE))
            audio.append(samples)
            at += len(samples) / SAMPLE_RATE
        pause = room_tone(float(rng.uniform(0.5, 1.0)), rng)
        audio.append(pause)
        at += len(pause) / SAMPLE_RATE
    return {"audio": np.concatenate(audio), "reference": " ".join(sentences), "words": truth}


def espeak_words(directory: Path, seed: int = 0) -> list[dict]:
    sentences = HARVARD + HARVARD_MORE
    files = []
    for index, count in enumerate([6, 6, 40, 40]):  # ~20 s, ~20 s, ~150 s, ~150 s
        rng = np.random.default_rng(seed + index)
        chosen = [sentences[i] for i in rng.choice(len(sentences), count, replace=False)]
        entry = espeak_words_file(chosen, directory, rng)
        entry["name"] = f"espeak-words-{index}"
        files.append(entry)
    return files


def speech_bounds(samples: np.ndarray) -> tuple[float, float]:
    """Where a recording's speech starts and ends, in seconds from its start."""
    frame = SAMPLE_RATE // 50
    energy = np.sqrt(np.mean(samples[: len(samples) // frame * frame].reshape(-1, frame) ** 2, axis=1))
    loud = np.flatnonzero(energy > SPEECH_ONSET * energy.max())
    return loud[0] * frame / SAMPLE_RATE, (loud[-1] + 1) * frame / SAMPLE_RATE


def real_en_files() -> list[dict]:
    from benchmarks.long_form import shared_pieces

    bounds = {piece.name: speech_bounds(piece.samples) for piece in shared_pieces("en")}
    files = []
    for entry in real_en():
        recordings = []
        for name, start, _end, text in entry["layout"]:
            first, last = bounds[name]
            recordings.append({"name": name, "text": text, "speech": (start + first, start + last)})
        files.append({"name": entry["name"], "audio": entry["audio"], "reference": entry["reference"],
                      "recordings": recordings})
    return files


# --- systems ---------------------------------------------------------------------------------


def asrserve_system(model: str, strategy: str | None):
    from asrserve import ASR

    asr = ASR(model)

    def run(audios):
        out = asr.transcribe(audios, language="en", word_timestamps=True, chunking_strategy=strategy)
        return [[(w.word, w.start, w.end) for w in t.words] for t in out]

    return run


def faster_whisper_system(model: str):
    from faster_whisper import WhisperModel

    fw = WhisperModel(str(faster_whisper_dir(model)), device="cpu", compute_type="int8", cpu_threads=2)

    def run(audios):
        out = []
        for audio in audios:
            segments, _ = fw.transcribe(audio, language="en", beam_size=1, word_timestamps=True)
            out.append([(w.word, w.start, w.end) for s in segments for w in s.words or []])
        return out

    return run


def make_system(name: str, model: str):
    if name == "asrserve":
        return asrserve_system(model, None)
    if name == "asrserve-energy":
        return asrserve_system(model, "energy")
    if name == "faster-whisper-int8":
        return faster_whisper_system(model)
    raise SystemExit(f"unknown system {name}")


# --- scoring ---------------------------------------------------------------------------------


def recognised_words(words: list[tuple[str, float, float]]) -> list[tuple[str, float, float]]:
    """One entry per normalised word ("well-oiled" may be one recognised word and two reference
    words: it is split, both halves keeping its times)."""
    out = []
    for text, start, end in words:
        out += [(w, start, end) for w in words_of(text)]
    return out


def matched(reference: list[str], recognised: list[tuple[str, float, float]]) -> list[tuple[int, int]]:
    """(reference index, recognised index) of the words a minimum-edit alignment keeps equal."""
    blocks = SequenceMatcher(None, reference, [w for w, _, _ in recognised], autojunk=False).get_matching_blocks()
    return [(block.a + k, block.b + k) for block in blocks for k in range(block.size)]


def score_espeak(files: list[dict], outputs: list[list]) -> dict:
    starts, ends, within_02, within_05, apart, total = [], [], 0, 0, 0, 0
    for entry, words in zip(files, outputs):
        truth = [(w, s, e) for word, s, e in entry["words"] for w in words_of(word)]
        recognised = recognised_words(words)
        total += len(truth)
        for i, j in matched([w for w, _, _ in truth], recognised):
            _, true_start, true_end = truth[i]
            _, start, end = recognised[j]
            starts.append(start - true_start)
            ends.append(end - true_end)
            worst = max(abs(starts[-1]), abs(ends[-1]))
            within_02 += worst <= 0.2
            within_05 += worst <= 0.5
            apart += end <= true_start or start >= true_end
    return summary(starts, ends, len(starts), within_02, within_05, apart, total)


def score_real(files: list[dict], outputs: list[list]) -> dict:
    """Each recording's first and last reference word, where recognised, against its speech's
    start and end."""
    starts, ends, within_02, within_05, apart, total = [], [], 0, 0, 0, 0
    for entry, words in zip(files, outputs):
        reference, edges = [], {}
        for index, recording in enumerate(entry["recordings"]):
            these = words_of(recording["text"])
            edges[len(reference)] = (index, "first")
            edges[len(reference) + len(these) - 1] = (index, "last")
            reference += these
        recognised = recognised_words(words)
        total += 2 * len(entry["recordings"])
        for i, j in matched(reference, recognised):
            if i not in edges:
                continue
            index, which = edges[i]
            speech_start, speech_end = entry["recordings"][index]["speech"]
            _, start, end = recognised[j]
            error = start - speech_start if which == "first" else end - speech_end
            (starts if which == "first" else ends).append(error)
            within_02 += abs(error) <= 0.2
            within_05 += abs(error) <= 0.5
            apart += end <= speech_start or start >= speech_end
    return summary(starts, ends, len(starts) + len(ends), within_02, within_05, apart, total)


def summary(starts, ends, scored, within_02, within_05, apart, total) -> dict:

    def stats(errors):
        if not errors:
            return None
        signed = np.asarray(errors)
        e = np.abs(signed)
        return {"median": round(float(np.median(e)), 3), "p90": round(float(np.percentile(e, 90)), 3),
                "mean": round(float(e.mean()), 3), "median_signed": round(float(np.median(signed)), 3)}

    return {"words": total, "scored": scored, "start_error_s": stats(starts), "end_error_s": stats(ends),
            "within_0.2s": round(within_02 / max(scored, 1), 3), "within_0.5s": round(within_05 / max(scored, 1), 3),
            "no_overlap": round(apart / max(scored, 1), 3)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny.en,base")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--sets", default=",".join(SETS))
    parser.add_argument("--save-result", type=Path)
    args = parser.parse_args()
    sets = args.sets.split(",")
    with tempfile.TemporaryDirectory() as directory:
        built = {}
        if "espeak-words" in sets:
            built["espeak-words"] = espeak_words(Path(directory))
        if "real-en" in sets:
            built["real-en"] = real_en_files() or None
    results = []
    for model in args.models.split(","):
        for system in args.systems.split(","):
            run = make_system(system, model)
            for set_name, files in built.items():
                if not files:
                    print(f"{set_name}: skipped (no ../shared/audio)")
                    continue
                outputs = run([f["audio"] for f in files])  # accuracy only: speed is long_form.py's
                scorer = score_espeak if set_name == "espeak-words" else score_real
                row = {"model": model, "system": system, "set": set_name}
                row |= scorer(files, outputs)
                if set_name == "espeak-words":  # the short files alone, then the long ones
                    row["short"] = scorer(files[:2], outputs[:2])
                    row["long"] = scorer(files[2:], outputs[2:])
                results.append(row)
                print(json.dumps(row), flush=True)
            del run
    print(table(results))
    if args.save_result:
        args.save_result.write_text(json.dumps({"results": results}, indent=1) + "\n")


def table(results: list[dict]) -> str:
    lines = ["| model | set | system | scored / words | start error median (p90) s | end error median (p90) s "
             "| both within 0.2 s | within 0.5 s | no overlap |",
             "| --- | --- | --- | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for row in results:
        start, end = row["start_error_s"] or {}, row["end_error_s"] or {}
        lines.append(
            f"| {row['model']} | {row['set']} | {row['system']} | {row['scored']} / {row['words']} "
            f"| {start.get('median', '-')} ({start.get('p90', '-')}) "
            f"| {end.get('median', '-')} ({end.get('p90', '-')}) "
            f"| {row['within_0.2s']:.0%} | {row['within_0.5s']:.0%} | {row['no_overlap']:.1%} |"
        )
    return "\n".join(lines)


if __name__ == "__main__":
    main()
