"""OpenAI's Realtime API, transcription sessions: the session configuration a client sets with
`session.update`, the session object the server echoes, server events and errors, as
openai-python's `types/realtime` defines them.

Only what a transcription session means is accepted; a field asrserve cannot honour gets an
`error` event naming it (param is the field's path, e.g. "session.audio.input.format.rate"),
never silent acceptance."""

from __future__ import annotations

import base64
import binascii
import re
import uuid
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from asrserve.audio.vad import DEFAULT_THRESHOLD
from asrserve.config import SAMPLE_RATE
from asrserve.entrypoints.live_decode import STABLE_LOGPROB_BY_DELAY
from asrserve.entrypoints.protocol import keywords_text
from asrserve.entrypoints.upload import MAX_FIELD_BYTES as MAX_PROMPT_BYTES
from asrserve.errors import cut, shown
from asrserve.model.languages import normalize_language

# OpenAI's server_vad defaults (realtime_transcription_session_audio_input_turn_detection.py).
VAD_PREFIX_PADDING_MS = 300
VAD_SILENCE_DURATION_MS = 500
LOGPROBS_INCLUDE = "item.input_audio_transcription.logprobs"
PCM_RATES = (24_000, 16_000)  # audio/pcm: OpenAI's 24 kHz, and 16 kHz (Whisper's own rate)
G711_RATE = 8_000


class RealtimeError(Exception):
    """Sent as an `error` event; the session goes on."""

    def __init__(self, message: str, *, param: str | None = None, code: str | None = None,
                 type: str = "invalid_request_error", event_id: str | None = None):
        super().__init__(message)
        self.message, self.param, self.code, self.type = message, param, code, type
        self.event_id = event_id  # the client event it answers, where found before the event was read

    def event(self, event_id: str | None) -> dict[str, Any]:
        error = {"type": self.type, "code": self.code, "message": self.message, "param": self.param,
                 "event_id": event_id}
        return server_event("error", error=error)


def new_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex[:22]}"


def server_event(kind: str, **fields: Any) -> dict[str, Any]:
    return {"type": kind, "event_id": new_id("event"), **fields}


@dataclass(frozen=True)
class ServerVAD:
    threshold: float = DEFAULT_THRESHOLD
    prefix_padding_ms: int = VAD_PREFIX_PADDING_MS
    silence_duration_ms: int = VAD_SILENCE_DURATION_MS

    def as_dict(self) -> dict[str, Any]:
        return {"type": "server_vad", "threshold": self.threshold, "prefix_padding_ms": self.prefix_padding_ms,
                "silence_duration_ms": self.silence_duration_ms}


@dataclass(frozen=True)
class SessionConfig:
    format: str = "audio/pcm"
    rate: int = 24_000
    model: str | None = None
    language: str | None = None
    prompt: str | None = None
    turn_detection: ServerVAD | None = field(default_factory=ServerVAD)
    include_logprobs: bool = False
    languages: tuple[str, ...] = ()  # OpenAI's: those the speech may be in (detection picks among them)
    keywords: tuple[str, ...] = ()  # and words to expect, read in front of the prompt
    delay: str | None = None  # OpenAI's: how long text waits before it is sent (live_decode.STABLE_LOGPROB_BY_DELAY)

    @property
    def prompt_head(self) -> str | None:  # (EngineRequest.prompt_head)
        return keywords_text(self.keywords)

    @property
    def input_rate(self) -> int:
        return self.rate if self.format == "audio/pcm" else G711_RATE

    def as_session(self, session_id: str) -> dict[str, Any]:
        """The session object of session.created / session.updated."""
        audio_format: dict[str, Any] = {"type": self.format}
        if self.format == "audio/pcm":
            audio_format["rate"] = self.rate
        return {
            "type": "transcription",
            "object": "realtime.transcription_session",
            "id": session_id,
            "audio": {
                "input": {
                    "format": audio_format,
                    "transcription": {"model": self.model, "language": self.language, "prompt": self.prompt,
                                      **({"languages": list(self.languages)} if self.languages else {}),
                                      **({"keywords": list(self.keywords)} if self.keywords else {}),
                                      **({"delay": self.delay} if self.delay else {})},
                    "turn_detection": self.turn_detection.as_dict() if self.turn_detection else None,
                    "noise_reduction": None,
                }
            },
            "include": [LOGPROBS_INCLUDE] if self.include_logprobs else [],
        }

    def updated(self, session: Any) -> "SessionConfig":
        """This configuration with a session.update's `session` applied (only the fields it
        has). Raises RealtimeError for a field that is wrong or that asrserve cannot honour."""
        session = _object(session, "session")
        if session.get("type", "transcription") != "transcription":
            raise RealtimeError(
                "this server runs transcription sessions: session.type must be 'transcription'", param="session.type",
            )
        _no_unknown(session, ("type", "audio", "include", "object", "id", "expires_at"), "session")
        config = self
        if "include" in session:
            include = [] if session["include"] is None else session["include"]
            if not isinstance(include, list) or any(item != LOGPROBS_INCLUDE for item in include):
                raise RealtimeError(f"session.include may only list {LOGPROBS_INCLUDE!r}", param="session.include")
            config = replace(config, include_logprobs=bool(include))
        audio = _object(_or_empty(session.get("audio")), "session.audio")
        _no_unknown(audio, ("input", "output"), "session.audio")
        if audio.get("output") is not None:
            raise RealtimeError("a transcription session has no audio output", param="session.audio.output")
        source = _object(_or_empty(audio.get("input")), "session.audio.input")
        _no_unknown(source, ("format", "transcription", "turn_detection", "noise_reduction"), "session.audio.input")
        if source.get("noise_reduction") is not None:
            raise RealtimeError(
                "input noise reduction is not available on this server; send null",
                param="session.audio.input.noise_reduction",
            )
        if "format" in source:
            config = _with_format(config, source["format"])
        if "transcription" in source:
            config = _with_transcription(config, source["transcription"])
        if "turn_detection" in source:
            config = replace(config, turn_detection=_turn_detection(source["turn_detection"]))
        return config


def _object(value: Any, param: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise RealtimeError(f"{param} must be an object", param=param)
    return value


def _or_empty(value: Any) -> Any:
    """An object left out or null is an empty one; anything else is what was sent (false, 0,
    "" and [] are not objects, and are refused as such)."""
    return {} if value is None else value


def _is_integer(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)  # JSON's true is not 1


def _no_unknown(value: dict[str, Any], known: tuple[str, ...], param: str) -> None:
    for name in value:
        if name not in known:
            name = cut(name)  # not kilobytes of a key, twice
            raise RealtimeError(f"unknown field {param}.{name} for a transcription session", param=f"{param}.{name}")


def _with_format(config: SessionConfig, value: Any) -> SessionConfig:
    param = "session.audio.input.format"
    value = _object(value, param)
    kind = value.get("type", "audio/pcm")
    if kind == "audio/pcm":
        rate = value.get("rate", 24_000)
        if not _is_integer(rate) or rate not in PCM_RATES:
            raise RealtimeError(f"audio/pcm rate must be 24000 or 16000, got {shown(rate)}", param=f"{param}.rate")
        return replace(config, format=kind, rate=rate)
    if kind in ("audio/pcmu", "audio/pcma"):
        return replace(config, format=kind, rate=G711_RATE)
    raise RealtimeError(
        f"unsupported input audio format {shown(kind)}: use audio/pcm, audio/pcmu or audio/pcma", param=f"{param}.type"
    )


def _with_transcription(config: SessionConfig, value: Any) -> SessionConfig:
    param = "session.audio.input.transcription"
    if value is None:
        raise RealtimeError("a transcription session always transcribes: transcription cannot be null", param=param)
    value = _object(value, param)
    _no_unknown(value, ("model", "language", "prompt", "languages", "keywords", "delay"), param)
    if value.get("delay") is not None and value["delay"] not in STABLE_LOGPROB_BY_DELAY:  # OpenAI's five values
        raise RealtimeError(f"{param}.delay must be one of {', '.join(STABLE_LOGPROB_BY_DELAY)}",
                            param=f"{param}.delay")
    for name in ("model", "language", "prompt"):
        if value.get(name) is not None and not isinstance(value[name], str):
            raise RealtimeError(f"{param}.{name} must be a string", param=f"{param}.{name}")
    for name in ("languages", "keywords"):
        items = value.get(name)
        if items is not None and (not isinstance(items, list) or not all(isinstance(item, str) for item in items)):
            raise RealtimeError(f"{param}.{name} must be a list of strings", param=f"{param}.{name}")
    keywords = value.get("keywords", config.keywords) or ()
    if len(", ".join(keywords).encode("utf-8", "surrogatepass")) > MAX_PROMPT_BYTES:
        raise RealtimeError(f"{param}.keywords are longer than {MAX_PROMPT_BYTES} bytes", param=f"{param}.keywords")
    if len((value.get("prompt") or "").encode("utf-8", "surrogatepass")) > MAX_PROMPT_BYTES:
        # as over HTTP (a form field's limit): the engine reads the last 223 tokens of a prompt,
        # and every decode of the session carries the whole of it to the engine
        raise RealtimeError(f"{param}.prompt is longer than {MAX_PROMPT_BYTES} bytes", param=f"{param}.prompt")
    config = replace(
        config,
        model=value.get("model", config.model),
        # the code ("ja" for "Japanese", " JA "), as the HTTP API takes it: where the text has no
        # spaces between words is decided on it (a name that is not one is refused beside)
        language=_language_code(value.get("language", config.language)),
        prompt=value.get("prompt", config.prompt) or None,
        languages=tuple(filter(None, map(_language_code, value.get("languages", config.languages) or ()))),
        keywords=tuple(keywords),
        delay=value.get("delay", config.delay),
    )
    if config.language and config.languages and config.language not in config.languages:
        raise RealtimeError(f"language {config.language!r} is not among languages {list(config.languages)}",
                            param=f"{param}.language")
    return config


def _language_code(language: str | None) -> str | None:
    return (normalize_language(language) or language) if language else None


def _turn_detection(value: Any) -> ServerVAD | None:
    param = "session.audio.input.turn_detection"
    if value is None:
        return None
    value = _object(value, param)
    if value.get("type") != "server_vad":
        raise RealtimeError(
            f"turn_detection type {shown(value.get('type'))} is not available: use server_vad, or null to commit "
            "the buffer yourself", param=f"{param}.type",
        )
    _no_unknown(value, ("type", "threshold", "prefix_padding_ms", "silence_duration_ms", "create_response",
                        "interrupt_response", "idle_timeout_ms"), param)
    if value.get("idle_timeout_ms") is not None:  # accepted, it would promise timeout_triggered events
        raise RealtimeError("idle_timeout_ms is not available on this server; send null",
                            param=f"{param}.idle_timeout_ms")
    threshold = value.get("threshold")
    threshold = DEFAULT_THRESHOLD if threshold is None else threshold
    if isinstance(threshold, bool) or not isinstance(threshold, (int, float)) or not 0.0 <= threshold <= 1.0:
        raise RealtimeError("threshold must be between 0 and 1", param=f"{param}.threshold")
    padding, silence = (value.get(name) for name in ("prefix_padding_ms", "silence_duration_ms"))
    padding = VAD_PREFIX_PADDING_MS if padding is None else padding
    silence = VAD_SILENCE_DURATION_MS if silence is None else silence
    if not _is_integer(padding) or not 0 <= padding <= 10_000:
        raise RealtimeError("prefix_padding_ms must be an integer from 0 to 10000", param=f"{param}.prefix_padding_ms")
    if not _is_integer(silence) or not 32 <= silence <= 10_000:
        raise RealtimeError("silence_duration_ms must be an integer from 32 to 10000",
                            param=f"{param}.silence_duration_ms")
    return ServerVAD(float(threshold), padding, silence)


# Where an event may hold a surrogate escape (a pair, as some encoders write emoji, is fine).
LONE_SURROGATE_ESCAPE = re.compile(r"\\u[dD][89a-fA-F]")


def is_text(value: Any) -> bool:
    """Whether every string in a parsed event encodes as UTF-8 (no lone surrogate). A loop, not
    recursion: the event may nest as deep as the JSON parser allowed."""
    pending = [value]
    while pending:
        value = pending.pop()
        if isinstance(value, str):
            try:
                value.encode("utf-8")
            except UnicodeEncodeError:
                return False
        elif isinstance(value, dict):
            pending.extend(value.keys())
            pending.extend(value.values())
        elif isinstance(value, list):
            pending.extend(value)
    return True


# --- input audio ---------------------------------------------------------------------------


def _mulaw_table() -> np.ndarray:
    """G.711 mu-law byte -> 16-bit sample (ITU-T G.711, as every telephony stack decodes it)."""
    code = ~np.arange(256, dtype=np.int32) & 0xFF
    exponent, mantissa = (code >> 4) & 7, code & 0x0F
    magnitude = (((mantissa << 3) + 0x84) << exponent) - 0x84
    return np.where(code & 0x80, -magnitude, magnitude).astype(np.float32)


def _alaw_table() -> np.ndarray:
    """G.711 A-law byte -> 16-bit sample."""
    code = np.arange(256, dtype=np.int32) ^ 0x55
    exponent, mantissa = (code >> 4) & 7, code & 0x0F
    magnitude = np.where(exponent == 0, (mantissa << 4) + 8, ((mantissa << 4) + 0x108) << np.maximum(exponent - 1, 0))
    return np.where(code & 0x80, magnitude, -magnitude).astype(np.float32)


_G711 = {"audio/pcmu": _mulaw_table() / 32768.0, "audio/pcma": _alaw_table() / 32768.0}


class InputAudioDecoder:
    """input_audio_buffer.append's base64 audio -> 16 kHz mono float32, resampled as a stream
    (no seams between appends)."""

    def __init__(self, config: SessionConfig):
        import soxr

        self.format = config.format
        rate = config.input_rate
        self._new_resampler = lambda: None if rate == SAMPLE_RATE else soxr.ResampleStream(
            rate, SAMPLE_RATE, 1, dtype="float32")
        self._resampler = self._new_resampler()
        # A 16-bit sample split between two appends (a client forwarding a byte stream in reads of
        # any size): its first byte waits for the next. Refused whole, an odd append lost its audio
        # and every append after it was read a byte off ("The question is..." for "Mr. Quilter").
        self._odd_byte = b""

    def flush(self) -> np.ndarray:
        """The samples the resampler still holds back (~20 ms), at the end of what was appended:
        a commit ends the buffer there, and the next item starts afresh."""
        if self._resampler is None:
            return np.zeros(0, np.float32)
        tail = self._resampler.resample_chunk(np.zeros(0, np.float32), last=True)
        self._resampler = self._new_resampler()
        return tail

    def decode(self, audio: Any) -> np.ndarray:
        if not isinstance(audio, str):
            raise RealtimeError("audio must be a base64 string", param="audio")
        try:
            data = base64.b64decode(audio, validate=True)
        except (binascii.Error, ValueError):
            raise RealtimeError("audio is not valid base64", param="audio", code="invalid_audio") from None
        if self.format == "audio/pcm":
            data = self._odd_byte + data
            whole = len(data) - len(data) % 2
            self._odd_byte = data[whole:]
            samples = np.frombuffer(data[:whole], dtype="<i2").astype(np.float32) / 32768.0
        else:
            samples = _G711[self.format][np.frombuffer(data, dtype=np.uint8)]
        if self._resampler is not None:
            samples = self._resampler.resample_chunk(samples)
        return samples
