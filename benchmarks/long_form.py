"""Long-form accuracy: recordings of 1-8 minutes, asrserve next to sequential long-form decoders
on the same weights (the bundled tiny.en and base CTranslate2 checkpoints).

    pip install -e '.[bench]'
    python benchmarks/long_form.py [--models tiny.en,base] [--sets real-en,espeak-en,...] [--layout-seed 0]
        [--systems ...] [--repeats 1] [--save-result long_form.json]

Sets (built deterministically at start-up as 16 kHz float32 wav files in a temporary folder;
every file has a reference text):
  real-en         5 files of 110-225 s: the English recordings of ../shared/audio (jfk, the
                  right channel of faster-whisper's stereo_diarization, the LibriSpeech
                  utterances, the 53 s sonnet reading, the 3-speaker clip) joined with pauses of
                  0.3-0.8 s (room tone at -80 dBFS, lengths drawn from a seeded generator), each
                  file starting the cycle at a different recording; the last runs the cycle
                  forwards then backwards (225 s).
  real-multi      multilingual models only: one file of ~80 s per language (de, es, fr, it, pt):
                  that language's one recorded sentence, 5 times, once every 15.5-19 s (pauses
                  of room tone between): no 30 s window holds 3 copies, whose text would fail
                  Whisper's compression-ratio check (> 2.4) although it is right.
                  The language is passed to every system; WER with Whisper's basic normaliser
                  (lower case, punctuation removed) instead of the English one.
  espeak-en       3 files of 94, 134 and 174 s: Harvard sentences (lists 1-8) spoken by
                  espeak-ng, 4-6 sentences per espeak call (so the pauses between sentences are
                  espeak's own), in four voices at 150-175 words a minute, calls joined with
                  0.4-1.2 s pauses.
  mostly-silence  2 files of 6 and 8 minutes of low white noise (-50 dBFS) with 4 short English
                  recordings each at known times (espeak-ng sentences without ../shared/audio).
                  Reference = those sentences: words hallucinated in the noise are insertions.
                  Its RTFx shows what skipping silence is worth. Its WER swings run to run
                  with the fallback's sampling (hallucinated loops after speech): --seed fixes
                  the draws; compare several seeds before reading much into one number.
Without ../shared/audio, real-en and real-multi are skipped.

Systems, each in its own process (no thread or allocator settings leak between them), all
greedy (beam 1) on the same weights, with each system's own long-form defaults otherwise:
  faster-whisper-int8 / -fp32  WhisperModel(compute_type=int8|float32, cpu_threads=2), one file at
                          a time, transcribe(beam_size=1, language=...) with its defaults:
                          sequential 30 s windows with timestamps, seek to the last segment,
                          temperature fallback, condition_on_previous_text=True, no VAD.
                          The target WER.
  faster-whisper-2w       the same in int8 with num_workers=2, cpu_threads=1, two files at a time
                          from two threads (its best throughput on 2 cores).
  faster-whisper-batched  BatchedInferencePipeline (int8, cpu_threads=2, batch_size=8; its
                          defaults: Silero VAD segments, no timestamps, no conditioning).
  transformers            WhisperForConditionalGeneration.generate long-form in float32
                          (return_timestamps=True, greedy, temperature fallback 0.0-1.0 with
                          compression_ratio_threshold=1.35 (its token-level equivalent of 2.4),
                          logprob_threshold=-1, no_speech_threshold=0.6, condition_on_prev_tokens
                          left at its default False), files batched by --transformers-batch.
  asrserve-<S>-seek / asrserve-<S>-noseek
                          ASR(model, dtype=--asrserve-dtype).transcribe(all files of the set at once,
                          language=[each file's], chunking_strategy=S, seek_continuation=True|False) with
                          OpenAI's defaults otherwise (temperature fallback on, plain text);
                          S = energy (cuts at quiet points) or auto (Silero VAD).
                          --asrserve-kwargs '{"timestamps": true}' adds keyword arguments.
  asrserve-auto-conditioned
                          previous-text conditioning measured (asrserve has no such mode): each
                          file's VAD pieces transcribed one after another, each with the text of
                          the pieces before it as its prompt (its last 800 characters), reset
                          after a piece decoded above temperature 0.5 (openai/whisper's
                          condition_on_previous_text and prompt reset); files one at a time.

Metrics per (model, set, system): pooled WER (all files' errors / all reference words), the
worst file's WER, per-file WER, normalised word counts of reference and output, inserted words
and "lost pieces" (recordings of which at least half the reference words are missed or wrong:
dropped stretches), errors per recording (JSON: by_recording, per_file[].pieces), wall seconds
and RTFx (seconds of audio / wall seconds) as the median of --repeats passes over the set after
a warm-up on a 40 s excerpt. --save-result writes every hypothesis too (and the sets' layouts:
which recording sits where in each file). --rescore F scores a saved file's hypotheses again
(the sets are rebuilt, deterministically) and prints its tables; --keep-audio DIR keeps the wavs.

On a machine whose cores other work is using, OpenMP's spinning threads slow torch down many
times over (a tiny.en decoder step: 0.8 s instead of 0.1 s); run with OMP_WAIT_POLICY=PASSIVE
there (the workers inherit the environment; the result file records it).
"""

from __future__ import annotations

import argparse
import csv
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import soundfile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asrserve.audio.decode import load_audio, to_model_input
from asrserve.benchmark.wer import english_normalizer, word_errors
from asrserve.config import SAMPLE_RATE
from benchmarks.workloads import HARVARD, SHARED_AUDIO

SETS = ["real-en", "real-multi", "espeak-en", "mostly-silence"]
MULTI_LANGUAGES = ["de", "es", "fr", "it", "pt"]
PEERS = ["faster-whisper-int8", "faster-whisper-fp32", "faster-whisper-2w", "faster-whisper-batched", "transformers"]
ASRSERVE = {
    f"asrserve-{strategy}-{'seek' if seek else 'noseek'}": (strategy, seek)
    for strategy in ("energy", "auto") for seek in (True, False)
}
# Issue 15's item 6, measured: pieces one after another, each conditioned on the text before.
CONDITIONED = "asrserve-auto-conditioned"
SYSTEMS = PEERS + list(ASRSERVE) + [CONDITIONED]

ROOM_TONE = 1e-4  # the pauses between joined recordings: -80 dBFS noise, not digital zeros
SILENCE_NOISE = 3e-3  # mostly-silence's background: about -50 dBFS white noise
WARMUP_SECONDS = 40
FALLBACK_TEMPERATURES = (0.0, 0.2, 0.4, 0.6, 0.8, 1.0)

# Harvard sentences, lists 5-8 (public domain): with workloads.HARVARD, 72 sentences.
HARVARD_MORE = [
    "A king ruled the state in the early days.", "The ship was torn apart on the sharp reef.",
    "Sickness kept him home the third week.", "The wide road shimmered in the hot sun.",
    "The lazy cow lay in the cool grass.", "Lift the square stone over the fence.",
    "The rope will bind the seven books at once.", "Hop over the fence and plunge in.",
    "The friendly gang left the drug store.", "Mesh wire keeps chicks inside.",
    "The frosty air passed through the coat.", "The crooked maze failed to fool the mouse.",
    "Adding fast leads to wrong sums.", "The show was a flop from the very start.",
    "A saw is a tool used for making boards.", "The wagon moved on well oiled wheels.",
    "March the soldiers past the next hill.", "A cup of sugar makes sweet fudge.",
    "Place a rosebush near the porch steps.", "Both lost their lives in the raging storm.",
    "We talked of the side show in the circus.", "Use a pencil to write the first draft.",
    "He ran half way to the hardware store.", "The clock struck to mark the third period.",
    "A small creek cut across the field.", "Cars and busses stalled in snow drifts.",
    "The set of china hit the floor with a crash.", "This is a grand season for hikes on the road.",
    "The dune rose from the edge of the water.", "Those words were the cue for the actor to leave.",
    "A yacht slid around the point into the bay.", "The two met while playing on the sand.",
    "The ink stain dried on the finished page.", "The walled town was seized without a fight.",
    "The lease ran out in sixteen weeks.", "A tame squirrel makes a nice pet.",
    "The horn of the car woke the sleeping cop.", "The heart beat strongly and with firm strokes.",
    "The pearl was worn in a thin silver ring.", "The fruit peel was cut in thick slices.",
]
ESPEAK_VOICES = ["en-us", "en-gb", "en-us+f3", "en-gb-x-rp"]


# --- the sets -------------------------------------------------------------------------------


@dataclass
class Piece:
    name: str
    samples: np.ndarray  # 16 kHz mono float32
    text: str

    @property
    def seconds(self) -> float:
        return len(self.samples) / SAMPLE_RATE


def short_english_recordings(max_s: float) -> list[Piece]:
    """../shared/audio's English recordings of at most `max_s` seconds; exits saying the folder
    is needed where there are none (the short-file benchmarks have nothing else to read)."""
    recordings = [piece for piece in shared_pieces("en") if len(piece.samples) <= max_s * SAMPLE_RATE]
    if not recordings:
        raise SystemExit("../shared/audio is needed for the English recordings")
    return recordings


def shared_pieces(language: str) -> list[Piece]:
    """../shared/audio's recordings in `language`, in manifest order ([] without the folder). A
    file whose reference gives one text per channel (two speakers talking at once) contributes
    its right channel: the left one is the LibriSpeech utterance already in the folder."""
    manifest = SHARED_AUDIO / "manifest.tsv"
    if not manifest.is_file():
        return []
    with open(manifest, encoding="utf-8") as file:
        rows = [row for row in csv.DictReader(file, delimiter="\t") if row["language"] == language]
    pieces = []
    for row in rows:
        path = SHARED_AUDIO / row["file"]
        name = row["file"].rsplit(".", 1)[0]
        text = row["reference_transcript"]
        right = re.search(r"\[right channel\]\s*(.*)$", text)
        if right:
            data, rate = soundfile.read(path, dtype="float32", always_2d=True)
            pieces.append(Piece(f"{name}[right]", to_model_input(data[:, -1], rate), right.group(1).strip()))
        else:
            pieces.append(Piece(name, load_audio(path), text))
    return pieces


def espeak(text: str, voice: str, speed: int, directory: Path) -> np.ndarray:
    path = directory / "espeak.wav"
    subprocess.run(["espeak-ng", "-v", voice, "-s", str(speed), "-w", str(path), text], check=True, capture_output=True)
    return load_audio(path)


def room_tone(seconds: float, rng: np.random.Generator, level: float = ROOM_TONE) -> np.ndarray:
    return (rng.standard_normal(int(round(seconds * SAMPLE_RATE))) * level).astype(np.float32)


def join(pieces: list[Piece], pauses: list[float], rng: np.random.Generator) -> tuple[np.ndarray, str, list]:
    """pieces[i] then pauses[i] seconds of room tone: (audio, reference, layout), where layout
    lists [name, start s, end s, text] for every piece."""
    audio, texts, layout, at = [], [], [], 0.0
    for piece, pause in zip(pieces, pauses, strict=True):
        audio += [piece.samples, room_tone(pause, rng)]
        texts.append(piece.text)
        layout.append([piece.name, round(at, 2), round(at + piece.seconds, 2), piece.text])
        at += piece.seconds + len(audio[-1]) / SAMPLE_RATE
    return np.concatenate(audio), " ".join(texts), layout


def real_en(rng_seed: int = 0) -> list[dict]:
    pieces = shared_pieces("en")
    if not pieces:
        return []
    files = []
    # (first recording, at least this many seconds); the last: the cycle forwards then backwards.
    plans = [(0, 90), (2, 150), (4, 200), (5, 120), (0, None)]
    for index, (first, minimum) in enumerate(plans):
        rng = np.random.default_rng(rng_seed + 100 + index)
        cycle = pieces[first:] + pieces[:first]
        if minimum is None:
            chosen, name = cycle + cycle[::-1], f"real-en-{index}-fwd-rev"
        else:
            chosen, name = [], f"real-en-{index}"
            while sum(p.seconds for p in chosen) < minimum:
                chosen.append(cycle[len(chosen) % len(cycle)])
        pauses = [float(rng.uniform(0.3, 0.8)) for _ in chosen]
        audio, text, layout = join(chosen, pauses, rng)
        files.append({"name": name, "audio": audio, "language": "en", "reference": text, "layout": layout})
    return files


def real_multi(rng_seed: int = 0) -> list[dict]:
    files = []
    for index, language in enumerate(MULTI_LANGUAGES):
        pieces = shared_pieces(language)
        if not pieces:
            continue
        rng = np.random.default_rng(rng_seed + 200 + index)
        # One sentence every 15.5-19 s: no 30 s window holds three copies of it. (Three copies of
        # one sentence compress 2.5-3x, past the 2.4 of Whisper's compression-ratio check: with
        # tighter repeats every system falls back to sampling on correct transcripts and drops
        # copies, which measures the repetition, not long-form decoding.)
        chosen, pauses = [], []
        while sum(p.seconds for p in chosen) + sum(pauses) < 75:
            chosen.append(pieces[len(chosen) % len(pieces)])
            pauses.append(max(0.3, float(rng.uniform(15.5, 19.0)) - chosen[-1].seconds))
        audio, text, layout = join(chosen, pauses, rng)
        files.append({"name": f"real-{language}", "audio": audio, "language": language, "reference": text,
                      "layout": layout})
    return files


def espeak_en(directory: Path, rng_seed: int = 0) -> list[dict]:
    pool = HARVARD + HARVARD_MORE
    files = []
    for index, target in enumerate([90, 125, 160]):
        rng = np.random.default_rng(rng_seed + 300 + index)
        order = list(rng.permutation(len(pool)))
        audio, texts, layout, at, call = [], [], [], 0.0, 0
        while at < target:
            if len(order) < 6:
                order += list(rng.permutation(len(pool)))
            count = int(rng.integers(4, 7))
            sentences = [pool[i] for i in order[:count]]
            del order[:count]
            voice, speed = ESPEAK_VOICES[(index + call) % len(ESPEAK_VOICES)], int(rng.integers(150, 176))
            samples = espeak(" ".join(sentences), voice, speed, directory)
            pause = room_tone(float(rng.uniform(0.4, 1.2)), rng)
            layout.append([f"espeak {voice} -s {speed}", round(at, 2), round(at + len(samples) / SAMPLE_RATE, 2),
                           " ".join(sentences)])
            audio += [samples, pause]
            texts += sentences
            at += (len(samples) + len(pause)) / SAMPLE_RATE
            call += 1
        files.append({"name": f"espeak-en-{index}", "audio": np.concatenate(audio), "language": "en",
                      "reference": " ".join(texts), "layout": layout})
    return files


def mostly_silence(directory: Path, rng_seed: int = 0) -> list[dict]:
    pool = [p for p in shared_pieces("en") if p.seconds < 25]  # not the 53 s sonnet
    if not pool:
        rng = np.random.default_rng(rng_seed + 400)
        pool = []
        for i in range(6):
            sentences = HARVARD_MORE[3 * i:3 * i + 3]
            pool.append(Piece(f"espeak {i}", espeak(" ".join(sentences), "en-us", 160, directory), " ".join(sentences)))
    # (length s, [(start s, index into pool)])
    plans = [(360, [(15, 0), (100, 3), (190, 2), (300, 4)]), (480, [(45, 5), (200, 1), (330, 0), (440, 3)])]
    files = []
    for index, (length, placements) in enumerate(plans):
        rng = np.random.default_rng(rng_seed + 410 + index)
        audio = room_tone(length, rng, SILENCE_NOISE)
        texts, layout = [], []
        for start, which in placements:
            piece = pool[which % len(pool)]
            begin = int(start * SAMPLE_RATE)
            audio[begin:begin + len(piece.samples)] += piece.samples[: len(audio) - begin]
            texts.append(piece.text)
            layout.append([piece.name, start, round(start + piece.seconds, 2), piece.text])
        files.append({"name": f"silence-{index}", "audio": audio, "language": "en", "reference": " ".join(texts),
                      "layout": layout})
    return files


def build_sets(names: list[str], directory: Path, layout_seed: int = 0) -> dict[str, list[dict]]:
    """Writes each set's files as float32 wav under directory/<set>/ and returns set -> files
    (name, file, language, reference, seconds, layout). Sets that cannot be built are left out.
    layout_seed draws other pauses, room tone, orders and voices: the same kind of set, laid
    out anew (0: the sets of docs/benchmarks.md)."""
    builders = {
        "real-en": lambda: real_en(layout_seed), "real-multi": lambda: real_multi(layout_seed),
        "espeak-en": lambda: espeak_en(directory, layout_seed),
        "mostly-silence": lambda: mostly_silence(directory, layout_seed),
    }
    sets = {}
    for name in names:
        files = builders[name]()
        if not files:
            print(f"{name}: skipped ({SHARED_AUDIO} is missing)", flush=True)
            continue
        (directory / name).mkdir(parents=True, exist_ok=True)
        for entry in files:
            path = directory / name / f"{entry['name']}.wav"
            soundfile.write(path, entry.pop("audio"), SAMPLE_RATE, subtype="FLOAT")
            entry["file"] = str(path.relative_to(directory))
            entry["seconds"] = round(soundfile.info(path).frames / SAMPLE_RATE, 3)
        sets[name] = files
    return sets


# --- the systems (run inside a worker process) ---------------------------------------------


def faster_whisper_dir(model: str) -> Path:
    """A CTranslate2 directory faster-whisper can open: the bundled one, or for a checkpoint
    shipped as model.bin.part1 + part2 (base), one built once under ~/.cache/asrserve-bench."""
    from asrserve.model.loader import _bundled

    checkpoint = _bundled(model)
    if checkpoint is None:
        raise SystemExit(f"bundled {model} is not installed")
    if len(checkpoint.directories) == 1 and (checkpoint.directories[0] / "model.bin").is_file():
        return checkpoint.directories[0]
    parts = sorted((p for d in checkpoint.directories for p in d.glob("model.bin.part*")),
                   key=lambda p: int(p.name.rsplit("part", 1)[1]))
    cache = Path(os.environ.get("ASRSERVE_BENCH_CACHE", Path.home() / ".cache" / "asrserve-bench")) / f"ct2-{model}"
    size = sum(p.stat().st_size for p in parts)
    if (cache / "model.bin").is_file() and (cache / "model.bin").stat().st_size == size:
        return cache
    building = Path(tempfile.mkdtemp(prefix=f"ct2-{model}-", dir=cache.parent if cache.parent.exists() else None))
    with open(building / "model.bin", "wb") as out:
        for part in parts:
            with open(part, "rb") as source:
                shutil.copyfileobj(source, out, 1 << 24)
    for directory in checkpoint.directories:
        for extra in directory.iterdir():
            if not extra.name.startswith("model.bin"):
                shutil.copy(extra, building / extra.name)
    cache.parent.mkdir(parents=True, exist_ok=True)
    if cache.exists():
        shutil.rmtree(cache)
    shutil.move(str(building), cache)
    return cache


def faster_whisper(model: str, compute_type: str, workers: int = 1, threads: int = 2, batched: bool = False):
    from faster_whisper import BatchedInferencePipeline, WhisperModel

    fw = WhisperModel(str(faster_whisper_dir(model)), device="cpu", compute_type=compute_type,
                      cpu_threads=threads, num_workers=workers)
    config = {"compute_type": compute_type, "cpu_threads": threads, "num_workers": workers, "beam_size": 1}
    if batched:
        pipeline = BatchedInferencePipeline(fw)
        config["batch_size"] = 8
        transcribe = lambda audio, language: pipeline.transcribe(  # noqa: E731
            audio, language=language, beam_size=1, batch_size=8)[0]
    else:
        transcribe = lambda audio, language: fw.transcribe(audio, language=language, beam_size=1)[0]  # noqa: E731
    one = lambda audio, language: " ".join(s.text.strip() for s in transcribe(audio, language))  # noqa: E731
    if workers == 1:
        return config, lambda audios, languages: [one(a, lang) for a, lang in zip(audios, languages)]
    pool = ThreadPoolExecutor(workers)
    return config, lambda audios, languages: list(pool.map(one, audios, languages))


def _by_language(languages: list[str]) -> dict[str, list[int]]:
    groups: dict[str, list[int]] = {}
    for index, language in enumerate(languages):
        groups.setdefault(language, []).append(index)
    return groups


def transformers_long_form(model_name: str, batch_size: int):
    import torch
    from transformers import WhisperFeatureExtractor

    from asrserve.model.loader import _bundled
    from asrserve.model.tokenizer import SpecialTokens, WhisperTokenizer
    from tests.hf_reference import bundled_hf_model

    model, generation = bundled_hf_model(model_name)
    special = SpecialTokens.for_vocab(model.config.vocab_size)
    generation.prev_sot_token_id = special.sot_prev
    generation.max_initial_timestamp_index = 50  # Whisper's max_initial_timestamp of 1 s
    directory = next(d for d in _bundled(model_name).directories if (d / "tokenizer.json").is_file())
    tokenizer = WhisperTokenizer.from_dir(directory, model.config.vocab_size)
    extractor = WhisperFeatureExtractor(feature_size=model.config.num_mel_bins)
    options = dict(return_timestamps=True, temperature=FALLBACK_TEMPERATURES, compression_ratio_threshold=1.35,
                   logprob_threshold=-1.0, no_speech_threshold=0.6)
    config = {"dtype": "float32", "batch_size": batch_size, "condition_on_prev_tokens": False}
    config |= {k: v for k, v in options.items()}

    def run(audios, languages):
        texts: list[str | None] = [None] * len(audios)
        for language, indices in _by_language(languages).items():
            extra = {"language": language, "task": "transcribe"} if generation.is_multilingual else {}
            for start in range(0, len(indices), batch_size):
                chunk = indices[start:start + batch_size]
                inputs = extractor([audios[i] for i in chunk], sampling_rate=SAMPLE_RATE, return_tensors="pt",
                                   truncation=False, padding="longest", return_attention_mask=True)
                if inputs.input_features.shape[-1] < 3000:  # short-form input must be exactly 30 s
                    inputs = extractor([audios[i] for i in chunk], sampling_rate=SAMPLE_RATE, return_tensors="pt",
                                       return_attention_mask=True)
                with torch.inference_mode():
                    out = model.generate(inputs.input_features, attention_mask=inputs.attention_mask,
                                         generation_config=generation, **options, **extra)
                for i, row in zip(chunk, out.tolist()):
                    texts[i] = tokenizer.decode(row)
        return texts

    return config, run


def asrserve_engine(model: str, dtype: str, quantization: str):
    """ASR(model) as the system asks for it, and what it resolved to (dtype, int8 encoder)."""
    from asrserve import ASR

    asr = ASR(model, dtype=dtype, encoder_quantization=quantization)
    runner = asr.engine.runner
    return asr, {"dtype": str(runner.dtype).removeprefix("torch."), "encoder_int8": runner.encoder_int8}


def asrserve_runner(model: str, strategy: str, seek: bool, extra: dict, dtype: str, quantization: str):
    asr, config = asrserve_engine(model, dtype, quantization)
    config |= {"chunking_strategy": strategy, "seek_continuation": seek} | extra

    def run(audios, languages):
        # Every file in one call, each in its own language: they decode side by side.
        out = asr.transcribe(audios, language=languages, chunking_strategy=strategy, seek_continuation=seek,
                             **extra)
        return [transcription.text for transcription in out]

    return config, run


def asrserve_conditioned(model: str, dtype: str, quantization: str):
    from asrserve.audio.chunking import ChunkingStrategy, cut_audio

    asr, config = asrserve_engine(model, dtype, quantization)
    config |= {"chunking_strategy": "auto", "conditioned": True}

    def transcribe(audio, language):
        texts: list[str] = []
        since = 0  # the prompt's first piece: after the last piece decoded above temperature 0.5
        for piece in cut_audio(audio, ChunkingStrategy("server_vad")):
            prompt = " ".join(texts[since:])[-800:] or None
            out = asr.transcribe(piece.samples, language=language, prompt=prompt, timestamps=True)[0]
            texts.append(out.text.strip())
            if max((segment.temperature for segment in out.segments or []), default=0.0) > 0.5:
                since = len(texts)
        return " ".join(text for text in texts if text)

    return config, lambda audios, languages: [transcribe(a, lang) for a, lang in zip(audios, languages)]


def make_system(name: str, model: str, args) -> tuple[dict, object]:
    if name == "faster-whisper-int8":
        return faster_whisper(model, "int8")
    if name == "faster-whisper-fp32":
        return faster_whisper(model, "float32")
    if name == "faster-whisper-2w":
        return faster_whisper(model, "int8", workers=2, threads=1)
    if name == "faster-whisper-batched":
        return faster_whisper(model, "int8", batched=True)
    if name == "transformers":
        return transformers_long_form(model, args.transformers_batch)
    if name == CONDITIONED:
        return asrserve_conditioned(model, args.asrserve_dtype, args.asrserve_encoder_quantization)
    strategy, seek = ASRSERVE[name]
    return asrserve_runner(model, strategy, seek, json.loads(args.asrserve_kwargs), args.asrserve_dtype,
                           args.asrserve_encoder_quantization)


def normalizer_for(set_name: str):
    if set_name == "real-multi":
        from whisper_normalizer.basic import BasicTextNormalizer

        return BasicTextNormalizer()
    return english_normalizer()


def alignment(ref: list[str], hyp: list[str]) -> list[tuple[str, int | None]]:
    """A minimum-edit alignment: (op, reference index) with op in ok/sub/del/ins (index None for
    an insertion)."""
    cost = [list(range(len(hyp) + 1))]
    for i, ref_word in enumerate(ref, 1):
        previous, current = cost[-1], [i] + [0] * len(hyp)
        for j, hyp_word in enumerate(hyp, 1):
            current[j] = min(previous[j] + 1, current[j - 1] + 1, previous[j - 1] + (ref_word != hyp_word))
        cost.append(current)
    ops, i, j = [], len(ref), len(hyp)
    while i or j:
        if i and j and cost[i][j] == cost[i - 1][j - 1] + (ref[i - 1] != hyp[j - 1]):
            ops.append(("ok" if ref[i - 1] == hyp[j - 1] else "sub", i - 1))
            i, j = i - 1, j - 1
        elif i and cost[i][j] == cost[i - 1][j] + 1:
            ops.append(("del", i - 1))
            i -= 1
        else:
            ops.append(("ins", None))
            j -= 1
    return ops[::-1]


def by_piece(entry: dict, hypothesis: str, normalize) -> list[dict] | None:
    """Errors per recording (layout entry) of one file: the reference words of each piece, the
    errors aligned to them, of which `missed` (substituted or deleted reference words) and
    `inserted` (words inserted after the piece's first word and before the next piece's: an
    insertion in the pause or silence after a piece counts against it). None for layouts
    without texts."""
    layout = entry.get("layout") or []
    if not layout or len(layout[0]) < 4:
        return None
    ref, owner = [], []
    for index, (_, _, _, text) in enumerate(layout):
        words = normalize(text).split()
        ref += words
        owner += [index] * len(words)
    counts = [[0, 0, 0] for _ in layout]  # words, missed, inserted
    for index in owner:
        counts[index][0] += 1
    last = 0
    for op, r in alignment(ref, normalize(hypothesis or "").split()):
        if r is not None:
            last = owner[r]
        if op in ("sub", "del"):
            counts[last][1] += 1
        elif op == "ins":
            counts[last][2] += 1
    return [{"piece": name, "start": start, "end": end, "words": words, "errors": missed + inserted,
             "missed": missed, "inserted": inserted}
            for (name, start, end, _), (words, missed, inserted) in zip(layout, counts)]


def score(files: list[dict], texts: list[str], normalize) -> dict:
    per_file, errors, words, hyp_words = [], 0, 0, 0
    recordings: dict[str, dict] = {}
    for entry, text in zip(files, texts, strict=True):
        ref, hyp = normalize(entry["reference"]).split(), normalize(text or "").split()
        wrong = word_errors(ref, hyp)
        row = {"file": entry["name"], "seconds": entry["seconds"], "wer": wrong / max(len(ref), 1),
               "errors": wrong, "ref_words": len(ref), "hyp_words": len(hyp), "hypothesis": text}
        pieces = by_piece(entry, text, normalize)
        if pieces is not None:
            # pieces whose words are mostly gone or wrong: what a dropped stretch looks like
            row["lost_pieces"] = [[p["piece"], p["start"], p["end"], p["missed"], p["words"]] for p in pieces
                                  if p["words"] >= 5 and p["missed"] >= 0.5 * p["words"]]
            row["pieces"] = pieces
            for p in pieces:
                total = recordings.setdefault(p["piece"], {"words": 0, "errors": 0, "missed": 0, "inserted": 0})
                for key in ("words", "errors", "missed", "inserted"):
                    total[key] += p[key]
        per_file.append(row)
        errors, words, hyp_words = errors + wrong, words + len(ref), hyp_words + len(hyp)
    worst = max(per_file, key=lambda f: f["wer"])
    for total in recordings.values():
        total["wer"] = total["errors"] / max(total["words"], 1)
    return {"wer": errors / max(words, 1), "errors": errors, "ref_words": words, "hyp_words": hyp_words,
            "worst_file": worst["file"], "worst_wer": worst["wer"], "by_recording": recordings, "per_file": per_file}


def seed_everything(seed: int) -> None:
    """Temperature fallback samples: seeded, a sequential system's output is the same run to run
    (two threads taking files in turn still interleave their draws)."""
    import random

    random.seed(seed)
    np.random.seed(seed)
    try:
        import ctranslate2

        ctranslate2.set_random_seed(seed)
    except ImportError:
        pass
    try:
        import torch

        torch.manual_seed(seed)
    except ImportError:
        pass


def worker(args) -> None:
    """One system, one model, every requested set, in this process: prints progress lines and
    finally `RESULT <json list>`."""
    directory = args.dir
    sets = json.loads((directory / "sets.json").read_text())
    sets = {name: sets[name] for name in args.sets.split(",") if name in sets}
    seed_everything(args.seed)
    try:
        config, run = make_system(args.worker, args.model, args)
        first = next(iter(sets.values()))[0]
        warm = load_audio(directory / first["file"])[: WARMUP_SECONDS * SAMPLE_RATE]
        run([warm], [first["language"]])  # warm-up: model load, first-call costs, VAD load
    except TypeError as error:
        if args.worker in ASRSERVE and "unexpected keyword" in str(error):  # chunking_strategy etc. not there yet
            print("RESULT " + json.dumps([{"system": args.worker, "model": args.model, "set": name,
                                           "skipped": f"TypeError: {error}"} for name in sets]), flush=True)
            return
        raise
    results = []
    for name, files in sets.items():
        audios = [load_audio(directory / f["file"]) for f in files]
        languages = [f["language"] for f in files]
        walls, texts = [], None
        for _ in range(args.repeats):
            start = time.perf_counter()
            out = run(audios, languages)
            walls.append(time.perf_counter() - start)
            texts = texts if texts is not None else out  # WER from the first timed pass
        wall = statistics.median(walls)
        audio_seconds = sum(len(a) for a in audios) / SAMPLE_RATE
        result = {"model": args.model, "set": name, "system": args.worker, "config": config,
                  "audio_seconds": audio_seconds, "wall_seconds": wall, "walls": walls, "rtfx": audio_seconds / wall}
        result |= score(files, texts, normalizer_for(name))
        results.append(result)
        print(f"progress {args.worker} {args.model} {name}: WER {100 * result['wer']:.1f}% RTFx {result['rtfx']:.1f}",
              flush=True)
    print("RESULT " + json.dumps(results), flush=True)


# --- the driver ------------------------------------------------------------------------------


def run_worker(system: str, model: str, sets: list[str], directory: Path, args) -> list[dict]:
    command = [sys.executable, __file__, "--worker", system, "--model", model, "--dir", str(directory),
               "--sets", ",".join(sets), "--repeats", str(args.repeats), "--seed", str(args.seed),
               "--transformers-batch", str(args.transformers_batch), "--asrserve-kwargs", args.asrserve_kwargs,
               "--asrserve-dtype", args.asrserve_dtype,
               "--asrserve-encoder-quantization", args.asrserve_encoder_quantization]
    log = directory / f"{system}-{model}.log"
    with open(log, "w") as stderr:
        process = subprocess.Popen(command, stdout=subprocess.PIPE, stderr=stderr, text=True)
        results = None
        for line in process.stdout:
            if line.startswith("RESULT "):
                results = json.loads(line[len("RESULT "):])
            elif line.startswith("progress "):
                print(f"  {line[len('progress '):].rstrip()}", flush=True)
        process.wait()
    if process.returncode != 0 or results is None:
        tail = log.read_text()[-3000:]
        print(f"  {system} ({model}) failed (exit {process.returncode}):\n{tail}", flush=True)
        return [{"model": model, "set": name, "system": system, "failed": tail} for name in sets]
    for result in results:
        if "skipped" in result:
            print(f"  {system} ({model}) {result['set']}: skipped, {result['skipped']}", flush=True)
    return results


def table(results: list[dict], model: str, set_name: str) -> str:
    rows = [r for r in results if r["model"] == model and r["set"] == set_name]
    lines = [f"### {model}, {set_name}", "",
             "| system | audio s | wall s | RTFx | WER % | worst file | worst WER % | per-file WER % | ref words "
             "| hyp words | inserted | lost pieces |",
             "| --- | ---: | ---: | ---: | ---: | --- | ---: | --- | ---: | ---: | ---: | ---: |"]
    notes = []
    for r in rows:
        if "wer" not in r:
            lines.append(f"| {r['system']} | {'skipped' if 'skipped' in r else 'failed'} | | | | | | | | | | |")
            continue
        per_file = " / ".join(f"{100 * f['wer']:.1f}" for f in r["per_file"])
        lost = [(f["file"], *piece) for f in r["per_file"] for piece in f.get("lost_pieces", [])]
        inserted = sum(p["inserted"] for f in r["per_file"] for p in f.get("pieces", []))
        lines.append(f"| {r['system']} | {r['audio_seconds']:.0f} | {r['wall_seconds']:.1f} | {r['rtfx']:.1f} "
                     f"| {100 * r['wer']:.1f} | {r['worst_file']} | {100 * r['worst_wer']:.1f} | {per_file} "
                     f"| {r['ref_words']} | {r['hyp_words']} | {inserted} | {len(lost)} |")
        if lost:
            notes.append(f"- {r['system']} lost (>= half the words missed or wrong): " + "; ".join(
                f"{file} {piece} {start:g}-{end:g} s ({errors}/{words})"
                for file, piece, start, end, errors, words in lost))
    return "\n".join(lines + ([""] + notes if notes else []))


def versions() -> dict:
    from importlib.metadata import PackageNotFoundError, version

    found = {}
    for package in ("torch", "transformers", "faster-whisper", "ctranslate2", "asrserve"):
        try:
            found[package] = version(package)
        except PackageNotFoundError:
            pass
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--models", default="tiny.en,base")
    parser.add_argument("--sets", default=",".join(SETS), help="real-multi runs only for multilingual models")
    parser.add_argument("--systems", default=",".join(SYSTEMS))
    parser.add_argument("--repeats", type=int, default=1, help="timed passes per set; the median is reported")
    parser.add_argument("--seed", type=int, default=0, help="seeds the fallback's sampling in every worker")
    parser.add_argument("--layout-seed", type=int, default=0,
                        help="builds the sets with other pauses, room tone and orders (0: the documented sets)")
    parser.add_argument("--transformers-batch", type=int, default=4, help="files per transformers generate call")
    parser.add_argument("--asrserve-dtype", default="auto",
                        help="asrserve's dtype: auto (what users get: bfloat16 where the CPU computes it) or float32")
    parser.add_argument("--asrserve-encoder-quantization", default="auto", choices=["auto", "int8", "none"],
                        help="asrserve's encoder quantization: auto (what users get: int8 linears where the CPU "
                             "runs the bf16 kernels and AVX512-VNNI) or none")
    parser.add_argument("--asrserve-kwargs", default="{}", help="JSON: more keyword arguments for ASR.transcribe")
    parser.add_argument("--keep-audio", type=Path, default=None, help="build the sets in this folder and keep them")
    parser.add_argument("--save-result", type=Path, default=None)
    parser.add_argument("--rescore", type=Path, default=None,
                        help="score a saved result's hypotheses again (sets rebuilt: they are deterministic), "
                             "rewrite it and print its tables")
    parser.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--model", default=None, help=argparse.SUPPRESS)
    parser.add_argument("--dir", type=Path, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()

    if args.worker:
        worker(args)
        return
    if args.rescore:
        rescore(args.rescore)
        return
    systems, set_names = args.systems.split(","), args.sets.split(",")
    unknown = (set(systems) - set(SYSTEMS)) | (set(set_names) - set(SETS))
    if unknown:
        sys.exit(f"unknown {sorted(unknown)}; systems: {', '.join(SYSTEMS)}; sets: {', '.join(SETS)}")
    json.loads(args.asrserve_kwargs)
    print(f"{os.cpu_count()} CPUs ({platform.processor() or platform.machine()}), {versions()}", flush=True)
    with tempfile.TemporaryDirectory(prefix="long_form-") as tmp:
        directory = args.keep_audio or Path(tmp)
        directory.mkdir(parents=True, exist_ok=True)
        sets = build_sets(set_names, directory, args.layout_seed)
        (directory / "sets.json").write_text(json.dumps(sets, indent=1))
        for name, files in sets.items():
            listing = ", ".join(f"{f['name']} {f['seconds']:.0f} s" for f in files)
            print(f"{name}: {len(files)} files, {sum(f['seconds'] for f in files):.0f} s ({listing})", flush=True)
        results = []
        for model in args.models.split(","):
            model_sets = [s for s in sets if s != "real-multi" or not model.endswith(".en")]
            for system in systems:
                print(f"{model} / {system} ...", flush=True)
                results += run_worker(system, model, model_sets, directory, args)
                if args.save_result:
                    save(args, results, sets)
        for model in args.models.split(","):
            for name in sets:
                if any(r["model"] == model and r["set"] == name for r in results):
                    print("\n" + table(results, model, name), flush=True)
        if args.save_result:
            save(args, results, sets)


def rescore(path: Path) -> None:
    saved = json.loads(path.read_text())
    names = [name for name in SETS if name in saved["sets"]]
    with tempfile.TemporaryDirectory(prefix="long_form-") as tmp:
        sets = build_sets(names, Path(tmp), saved.get("layout_seed", 0))
    for name, files in sets.items():
        if [f["reference"] for f in files] != [f["reference"] for f in saved["sets"][name]]:
            sys.exit(f"{name}: the rebuilt set differs from the saved one")
    for result in saved["results"]:
        if "per_file" in result:
            hypotheses = [f["hypothesis"] for f in result["per_file"]]
            result |= score(sets[result["set"]], hypotheses, normalizer_for(result["set"]))
    saved["sets"] = {name: [{k: v for k, v in f.items() if k != "file"} for f in files] for name, files in sets.items()}
    path.write_text(json.dumps(saved, indent=1, ensure_ascii=False) + "\n")
    models = list(dict.fromkeys(r["model"] for r in saved["results"]))
    for model in models:
        for name in sets:
            if any(r["model"] == model and r["set"] == name for r in saved["results"]):
                print("\n" + table(saved["results"], model, name), flush=True)


def save(args, results: list[dict], sets: dict) -> None:
    args.save_result.parent.mkdir(parents=True, exist_ok=True)
    args.save_result.write_text(json.dumps({
        "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(), "versions": versions(),
        "repeats": args.repeats, "seed": args.seed, "layout_seed": args.layout_seed,
        "command": " ".join(sys.argv),
        "env": {k: os.environ[k] for k in ("OMP_WAIT_POLICY", "OMP_NUM_THREADS", "MKL_NUM_THREADS") if k in os.environ},
        "sets": {name: [{k: v for k, v in f.items() if k != "file"} for f in files] for name, files in sets.items()},
        "results": results,
    }, indent=1, ensure_ascii=False) + "\n")


if __name__ == "__main__":
    main()
