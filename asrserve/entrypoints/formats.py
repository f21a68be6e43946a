"""Transcripts rendered in OpenAI's response formats: verbose_json, srt and vtt."""

from __future__ import annotations

from typing import Any

from asrserve.entrypoints.segments import Segment
from asrserve.model.languages import LANGUAGES

CONTENT_TYPES = {
    "srt": "application/x-subrip; charset=utf-8",
    "vtt": "text/vtt; charset=utf-8",
    "text": "text/plain; charset=utf-8",
}


def format_timestamp(seconds: float, decimal_marker: str) -> str:
    """HH:MM:SS,mmm (srt) or HH:MM:SS.mmm (vtt)."""
    milliseconds = max(0, round(seconds * 1000))
    hours, milliseconds = divmod(milliseconds, 3_600_000)
    minutes, milliseconds = divmod(milliseconds, 60_000)
    secs, milliseconds = divmod(milliseconds, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{decimal_marker}{milliseconds:03d}"


def _one_line(segment: Segment) -> str:
    """A cue's text on one line: a blank line would end the cue."""
    return " ".join(segment.text.split())


def _cue_text(segment: Segment) -> str:
    """SRT cue text: SRT has no escapes, so a '-->' (it starts a cue) loses a dash."""
    return _one_line(segment).replace("-->", "->")


def _vtt_cue_text(segment: Segment) -> str:
    """WebVTT cue text, where '<' opens a tag and '&' a character reference: a transcript's
    "x < y" or "AT&T" would lose text in a player. Escaped, the text reads back exactly, and
    '-->' can no longer appear in it."""
    return _one_line(segment).replace("&", "&amp;").replace("<", "&lt;").replace(">", "&gt;")


def to_srt(segments: list[Segment]) -> str:
    cues = [segment for segment in segments if _cue_text(segment)]
    return "".join(
        f"{number}\n{format_timestamp(s.start, ',')} --> {format_timestamp(s.end, ',')}\n{_cue_text(s)}\n\n"
        for number, s in enumerate(cues, start=1)
    )


def to_vtt(segments: list[Segment]) -> str:
    cues = "".join(
        f"{format_timestamp(s.start, '.')} --> {format_timestamp(s.end, '.')}\n{_vtt_cue_text(s)}\n\n"
        for s in segments
        if _one_line(s)
    )
    return "WEBVTT\n\n" + cues


def reported_language(task: str, language: str | None) -> str:
    """The language as OpenAI's verbose_json names it: in lower-case English ("english",
    "german"), as Whisper's own table does, not the ISO code. A translation's is its output's
    (OpenAI's type: "always `english`"). A transcription of which no audio reached the model
    (digital silence, no speech found) on a multilingual model has none detected: English, as
    Whisper reads silence (pieces.spoken_language names a listed language instead)."""
    if task == "translate" or language is None:
        return LANGUAGES["en"]
    return LANGUAGES.get(language, language)


def to_verbose_json(
    task: str,
    language: str | None,
    duration_s: float,
    text: str,
    segments: list[Segment],
    with_words: bool,
    usage: dict[str, Any],
    with_segments: bool = True,
) -> dict[str, Any]:
    """OpenAI's verbose_json: segments unless only words were asked for (its
    timestamp_granularities=["word"] answers with words alone), words where asked for."""
    body: dict[str, Any] = {
        "task": task,
        "language": reported_language(task, language),
        "duration": round(duration_s, 3),
        "text": text,
    }
    if with_segments:
        body["segments"] = [
            {
                "id": s.id,
                "seek": s.seek,
                "start": round(s.start, 3),
                "end": round(s.end, 3),
                "text": s.text,
                "tokens": s.tokens,
                "temperature": s.temperature,
                "avg_logprob": s.avg_logprob,
                "compression_ratio": s.compression_ratio,
                "no_speech_prob": s.no_speech_prob,
            }
            for s in segments
        ]
    if with_words:
        body["words"] = [
            {"word": w.word, "start": round(w.start, 3), "end": round(w.end, 3)} for s in segments for w in s.words
        ]
    body["usage"] = usage
    return body
