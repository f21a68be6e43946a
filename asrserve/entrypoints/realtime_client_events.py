"""Client events of a live session as they come off the socket: JSON text read into an event
and its event_id, and OpenAI's beta Realtime protocol read as the current one.

The beta protocol (`OpenAI-Beta: realtime=v1`: openai-python 1.x's `client.beta.realtime`, Home
Assistant's OpenAI speech-to-text integrations) sets a transcription session with
`transcription_session.update`, whose session is flat (`input_audio_format: "pcm16"`,
`input_audio_transcription`, `turn_detection`, `input_audio_noise_reduction`), and is answered
with `transcription_session.updated` in that shape. Its other events (input_audio_buffer.*,
conversation.item.input_audio_transcription.*) have the names and fields of the current protocol."""

from __future__ import annotations

import json
import re
from typing import Any

from asrserve.entrypoints.realtime_protocol import LONE_SURROGATE_ESCAPE, RealtimeError, is_text, server_event
from asrserve.errors import cut, shown

MAX_EVENT_BYTES = 15 * 1024 * 1024 * 4 // 3 + 1024  # OpenAI's 15 MiB of audio per append, in base64
SESSION_UPDATE = "session.update"
BETA_SESSION_UPDATE = "transcription_session.update"
SESSION_UPDATES = (SESSION_UPDATE, BETA_SESSION_UPDATE)
BETA_FORMATS = {"pcm16": {"type": "audio/pcm", "rate": 24_000}, "g711_ulaw": {"type": "audio/pcmu"},
                "g711_alaw": {"type": "audio/pcma"}}
# A beta field -> where the current protocol has it (errors name the field the client sent).
BETA_FIELDS = {"input_audio_format": "audio.input.format", "input_audio_transcription": "audio.input.transcription",
               "turn_detection": "audio.input.turn_detection",
               "input_audio_noise_reduction": "audio.input.noise_reduction"}

# An event too large to parse still names its event_id, usually before its audio.
_EVENT_ID = re.compile(r'"event_id"\s*:\s*"((?:[^"\\]|\\.){0,512})"')


def parse_event(message: dict[str, Any]) -> tuple[dict[str, Any], str | None]:
    """The event and its event_id; a RealtimeError carries the event_id where one was found."""
    text = message.get("text")
    if text is None:
        raise RealtimeError("send events as JSON text frames, not binary", code="invalid_event")
    if len(text) > MAX_EVENT_BYTES:
        raise RealtimeError("an event may carry at most 15 MiB of audio", code="event_too_large",
                            event_id=_event_id_in(text))
    try:
        event = json.loads(text)
    except json.JSONDecodeError as error:
        raise RealtimeError(f"the event is not valid JSON: {error.msg}", code="invalid_json") from None
    except (ValueError, RecursionError):  # an integer of thousands of digits, arrays nested thousands deep
        raise RealtimeError("the event is not JSON we read: a number too long or nesting too deep",
                            code="invalid_json") from None
    event_id = event.get("event_id") if isinstance(event, dict) else None
    event_id = event_id if isinstance(event_id, str) and is_text(event_id) else None
    if LONE_SURROGATE_ESCAPE.search(text) and not is_text(event):
        # "\ud800" alone is valid JSON but not text: it cannot be sent back, tokenized or logged.
        raise RealtimeError("the event holds a lone UTF-16 surrogate escape (\\ud800-\\udfff), which is not text",
                            code="invalid_json", event_id=event_id)
    if not isinstance(event, dict) or not isinstance(event.get("type"), str):
        raise RealtimeError("an event must be a JSON object with a string `type`", param="type",
                            code="invalid_event", event_id=event_id)
    return event, event_id


def _event_id_in(text: str) -> str | None:
    found = _EVENT_ID.search(text)
    try:
        event_id = json.loads(f'"{found.group(1)}"') if found else None
    except json.JSONDecodeError:
        return None
    return event_id if is_text(event_id) else None


def session_of(event: dict[str, Any]) -> Any:
    """The session (the current protocol's shape) a session.update or a beta
    transcription_session.update sets."""
    if event.get("type") != BETA_SESSION_UPDATE:
        return event.get("session")
    session = event.get("session")
    if not isinstance(session, dict):
        raise RealtimeError("session must be an object", param="session")
    source: dict[str, Any] = {}
    for name, value in session.items():
        if name == "input_audio_format":
            if not isinstance(value, str) or value not in BETA_FORMATS:
                raise RealtimeError(f"input_audio_format must be pcm16, g711_ulaw or g711_alaw, got {shown(value)}",
                                    param="session.input_audio_format")
            source["format"] = BETA_FORMATS[value]
        elif name in BETA_FIELDS:
            source[BETA_FIELDS[name].rsplit(".", 1)[1]] = value
        elif name == "modalities" and (value is None or isinstance(value, list) and set(value) <= {"text", "audio"}):
            pass  # (a transcription session gives text whatever it lists)
        elif name not in ("include", "client_secret"):  # (client_secret: a REST session's, read by none here)
            raise RealtimeError(f"unknown field session.{cut(name)} for a transcription session",
                                param=f"session.{cut(name)}")
    current = {"type": "transcription", "audio": {"input": source}}
    if "include" in session:
        current["include"] = session["include"]
    return current


def session_updated(event: dict[str, Any], session: dict[str, Any]) -> dict[str, Any]:
    """The answer to a session update: `session` (SessionConfig.as_session) as session.updated,
    or in the beta's shape as transcription_session.updated."""
    if event.get("type") != BETA_SESSION_UPDATE:
        return server_event("session.updated", session=session)
    source = session["audio"]["input"]
    audio_format = next((name for name, value in BETA_FORMATS.items() if value == source["format"]),
                        source["format"])  # (16 kHz PCM, which only the current protocol sets, as it is)
    beta = {"object": session["object"], "id": session["id"], "input_audio_format": audio_format,
            "input_audio_transcription": source["transcription"], "turn_detection": source["turn_detection"],
            "input_audio_noise_reduction": source["noise_reduction"], "include": session["include"],
            "modalities": ["text"]}
    return server_event("transcription_session.updated", session=beta)


def in_beta_terms(error: RealtimeError) -> RealtimeError:
    """An error about a beta transcription_session.update, naming the fields as the client sent
    them (session.turn_detection.threshold, not session.audio.input.turn_detection.threshold)."""
    for beta, current in BETA_FIELDS.items():
        error.message = error.message.replace(f"session.{current}", f"session.{beta}")
        if error.param and error.param.startswith(f"session.{current}"):
            error.param = f"session.{beta}" + error.param[len(f"session.{current}"):]
    return error
