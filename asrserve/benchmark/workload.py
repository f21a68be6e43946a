"""The audio a benchmark sends: every audio file of a folder, with reference texts from an
optional manifest."""

from __future__ import annotations

import csv
import json
import mimetypes
from dataclasses import dataclass
from pathlib import Path

from asrserve.audio.decode import AudioError, load_audio
from asrserve.config import SAMPLE_RATE

AUDIO_SUFFIXES = {".wav", ".flac", ".mp3", ".ogg", ".opus", ".m4a", ".mp4", ".webm", ".aac", ".mpga", ".mpeg"}
# Column names a manifest may use for the file and for its reference text.
FILE_COLUMNS = ("file", "path", "audio", "filename")
TEXT_COLUMNS = ("text", "reference", "reference_transcript", "transcript", "sentence")


@dataclass(frozen=True)
class AudioFile:
    name: str
    data: bytes
    mime_type: str
    duration_s: float
    reference: str | None  # what was said, when a manifest gives it


def load_workload(audio_dir: Path, manifest: Path | None = None) -> list[AudioFile]:
    """The folder's audio files in name order. A manifest (TSV or CSV with a header, or JSON
    lines) names files relative to the folder and gives their reference texts; with one, only
    the files it lists are sent."""
    audio_dir = Path(audio_dir)
    if not audio_dir.is_dir():
        raise ValueError(f"{audio_dir} is not a folder")
    if manifest is not None:
        references = read_manifest(Path(manifest))
        paths = [audio_dir / name for name in references]
        missing = [str(p) for p in paths if not p.is_file()]
        if missing:
            raise ValueError(f"the manifest names files that are not in {audio_dir}: {', '.join(missing[:3])}")
    else:
        references = {}
        paths = sorted(p for p in audio_dir.iterdir() if p.suffix.lower() in AUDIO_SUFFIXES and p.is_file())
    if not paths:
        raise ValueError(f"no audio files in {audio_dir} (looked for {', '.join(sorted(AUDIO_SUFFIXES))})")
    files = []
    # By the manifest's names: a file in a subfolder ("sub/x.wav") keeps its reference.
    names = list(references) if manifest is not None else [path.name for path in paths]
    for name, path in zip(names, paths):
        data = path.read_bytes()
        try:
            duration = len(load_audio(data)) / SAMPLE_RATE  # decoded as the server will, for RTFx
        except AudioError as error:
            raise ValueError(f"{path}: {error}") from None
        mime = mimetypes.guess_type(path.name)[0] or "application/octet-stream"
        files.append(AudioFile(path.name, data, mime, duration, references.get(name)))
    return files


def read_manifest(path: Path) -> dict[str, str]:
    """file name -> reference text, in the manifest's order."""
    text = path.read_text(encoding="utf-8")
    if path.suffix in (".jsonl", ".json"):
        rows = [json.loads(line) for line in text.splitlines() if line.strip()]
    else:
        dialect = "excel-tab" if path.suffix == ".tsv" or "\t" in text.split("\n", 1)[0] else "excel"
        rows = list(csv.DictReader(text.splitlines(), dialect=dialect))
    if not rows:
        raise ValueError(f"manifest {path} is empty")
    file_column = next((c for c in FILE_COLUMNS if c in rows[0]), None)
    text_column = next((c for c in TEXT_COLUMNS if c in rows[0]), None)
    if file_column is None or text_column is None:
        raise ValueError(
            f"manifest {path} needs a file column ({'/'.join(FILE_COLUMNS)}) and a text column "
            f"({'/'.join(TEXT_COLUMNS)}); it has {', '.join(rows[0])}"
        )
    return {row[file_column]: row[text_column] for row in rows}
