"""The audio the benchmarks send: short spoken sentences, and long recordings of real speech.

Both come with reference texts, so every benchmark reports WER next to speed."""

from __future__ import annotations

import csv
import hashlib
import os
import shutil
import subprocess
from pathlib import Path

import numpy as np
import soundfile

from asrserve.audio.decode import load_audio
from asrserve.config import SAMPLE_RATE

SHARED_AUDIO = Path(__file__).resolve().parents[2] / "shared" / "audio"

# Harvard sentences, lists 1-4 (public domain).
HARVARD = [
    "The birch canoe slid on the smooth planks.", "Glue the sheet to the dark blue background.",
    "It's easy to tell the depth of a well.", "These days a chicken leg is a rare dish.",
    "Rice is often served in round bowls.", "The juice of lemons makes fine punch.",
    "The box was thrown beside the parked truck.", "The hogs were fed chopped corn and garbage.",
    "Four hours of steady work faced us.", "A large size in stockings is hard to sell.",
    "The boy was there when the sun rose.", "A rod is used to catch pink salmon.",
    "The source of the huge river is the clear spring.", "Kick the ball straight and follow through.",
    "Help the woman get back to her feet.", "A pot of tea helps to pass the evening.",
    "Smoky fires lack flame and heat.", "The soft cushion broke the man's fall.",
    "The salt breeze came across from the sea.", "The girl at the booth sold fifty bonds.",
    "The small pup gnawed a hole in the sock.", "The fish twisted and turned on the bent hook.",
    "Press the pants and sew a button on the vest.", "The swan dive was far short of perfect.",
    "The beauty of the view stunned the young boy.", "Two blue fish swam in the tank.",
    "Her purse was full of useless trash.", "The colt reared and threw the tall rider.",
    "It snowed, rained, and hailed the same morning.", "Read verse out loud for pleasure.",
    "Hoist the load to your left shoulder.", "Take the winding path to reach the lake.",
]


# A folder of what espeak-ng said, by voice and text: filled where espeak-ng is installed, read
# where it is not (a bare GPU machine; benchmarks/gpu_prepare.py --suite fills it).
SPEECH_CACHE = "ASRSERVE_SPEECH_CACHE"


def have_espeak() -> bool:
    """espeak-ng is installed, or $ASRSERVE_SPEECH_CACHE holds what it said before."""
    cache = os.environ.get(SPEECH_CACHE)
    return shutil.which("espeak-ng") is not None or bool(cache and Path(cache).is_dir())


def speak(text: str, path: Path, voice: str = "en-us") -> Path:
    """espeak-ng's wav of `text` at `path`, through $ASRSERVE_SPEECH_CACHE when it is set."""
    cache = os.environ.get(SPEECH_CACHE)
    cached = Path(cache) / (hashlib.sha1(f"{voice}\0{text}".encode()).hexdigest()[:20] + ".wav") if cache else None
    if shutil.which("espeak-ng") is None and cached is not None:
        if not cached.is_file():
            raise FileNotFoundError(f"espeak-ng is not installed and {cached} ({voice}: {text!r}) was not kept")
        shutil.copy(cached, path)
        return path
    subprocess.run(["espeak-ng", "-v", voice, "-w", str(path), text], check=True, capture_output=True)
    if cached is not None:
        cached.parent.mkdir(parents=True, exist_ok=True)
        shutil.copy(path, cached)
    return path


def write_manifest(directory: Path, references: dict[str, str]) -> Path:
    """manifest.tsv (file, text) for `asrserve bench --manifest`."""
    path = directory / "manifest.tsv"
    with open(path, "w", encoding="utf-8") as file:
        file.write("file\ttext\n")
        for name, text in references.items():
            file.write(f"{name}\t{text}\n")
    return path


def short_clips(count: int, directory: Path) -> dict[str, str]:
    """`count` Harvard sentences spoken by espeak-ng (~2.4 s each) as wav files in `directory`:
    file name -> the sentence."""
    references = {}
    for i in range(count):
        text = HARVARD[i % len(HARVARD)]
        name = f"clip{i:02d}.wav"
        speak(text, directory / name)
        references[name] = text
    return references


def english_recordings() -> list[tuple[np.ndarray, str]]:
    """The English recordings of ../shared/audio with their reference texts ([] without it)."""
    manifest = SHARED_AUDIO / "manifest.tsv"
    if not manifest.is_file():
        return []
    with open(manifest, encoding="utf-8") as file:
        rows = [row for row in csv.DictReader(file, delimiter="\t") if row["language"] == "en"]
    return [(load_audio(SHARED_AUDIO / row["file"]), row["reference_transcript"]) for row in rows]


def long_recordings(count: int, min_seconds: float, directory: Path) -> dict[str, str]:
    """`count` recordings of at least `min_seconds`: real speech (../shared/audio's English
    recordings joined with 0.5 s pauses, each recording starting the cycle at a different one),
    or espeak-ng sentences without the folder. File name -> reference text."""
    pieces = english_recordings()
    if not pieces:
        names = short_clips(len(HARVARD), directory)
        pieces = [(load_audio(directory / name), text) for name, text in names.items()]
    pause = np.zeros(SAMPLE_RATE // 2, np.float32)
    references = {}
    for index in range(count):
        audio, texts = [], []
        order = pieces[index % len(pieces):] + pieces[: index % len(pieces)]
        while sum(len(a) for a in audio) < min_seconds * SAMPLE_RATE:
            for samples, text in order:
                audio += [samples, pause]
                texts.append(text)
        name = f"long{index}.wav"
        soundfile.write(directory / name, np.concatenate(audio), SAMPLE_RATE)
        references[name] = " ".join(texts)
    return references


def mixed_clips(directory: Path, seed: int = 0) -> dict[str, str]:
    """What a short-clip service gets, where Whisper's fallback has work to do: 24 Harvard
    sentences by espeak-ng, 8 of them again under white noise at 5 dB SNR, and (with
    ../shared/audio) its real recordings of up to 30 s: English, and one each in German,
    Spanish, French, Italian and Portuguese (tiny.en cannot read those: its decodes fail the
    checks and fall back). File name -> reference text."""
    references = short_clips(24, directory)
    rng = np.random.default_rng(seed)
    for name in list(references)[:8]:
        clean = load_audio(directory / name)
        noise = rng.normal(0, 1, len(clean)).astype(np.float32)
        noise *= np.sqrt(np.mean(clean**2) / np.mean(noise**2) / 10 ** (5 / 10))
        noisy = f"noisy-{name}"
        soundfile.write(directory / noisy, np.clip(clean + noise, -1, 1), SAMPLE_RATE)
        references[noisy] = references[name]
    manifest = SHARED_AUDIO / "manifest.tsv"
    if manifest.is_file():
        with open(manifest, encoding="utf-8") as file:
            for row in csv.DictReader(file, delimiter="\t"):
                # The stereo file's reference names its channels; it is left out.
                if float(row["duration_seconds"]) > 30 or "[" in row["reference_transcript"]:
                    continue
                name = f"real-{Path(row['file']).stem}.wav"
                soundfile.write(directory / name, load_audio(SHARED_AUDIO / row["file"]), SAMPLE_RATE)
                references[name] = row["reference_transcript"]
    return references
