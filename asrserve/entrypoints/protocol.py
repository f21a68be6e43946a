"""The OpenAI audio API's request fields, responses and error shape."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from asrserve.engine.request import MAX_BEST_OF, MAX_SEED, MIN_SEED

RESPONSE_FORMATS = ("json", "text", "srt", "verbose_json", "vtt")
# Formats built from segment timestamps (the model decodes with timestamp tokens for them).
TIMESTAMPED_FORMATS = ("srt", "verbose_json", "vtt")
DIARIZATION_FIELDS = ("known_speaker_names", "known_speaker_references")


class APIError(Exception):
    """An error the client gets as {"error": {message, type, param, code}} with this status."""

    def __init__(
        self,
        status_code: int,
        message: str,
        *,
        type: str = "invalid_request_error",
        param: str | None = None,
        code: str | None = None,
        headers: dict[str, str] | None = None,
    ):
        super().__init__(message)
        self.status_code = status_code
        self.message = message
        self.type = type
        self.param = param
        self.code = code
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class TranscriptionRequest(BaseModel):
    """The form fields of /v1/audio/transcriptions and /v1/audio/translations (less the file)."""

    model_config = ConfigDict(extra="ignore")

    model: str | None = None
    language: str | None = None
    prompt: str | None = None
    response_format: Literal["json", "text", "srt", "verbose_json", "vtt"] = "json"
    temperature: float = Field(0.0, ge=0.0, le=1.0, allow_inf_nan=False)
    stream: bool = False
    timestamp_granularities: list[Literal["word", "segment"]] = Field(default_factory=list)
    # OpenAI's languages[] (those the audio may be in: language detection picks among them) and
    # keywords[] (words and phrases to expect: Whisper reads them in front of the prompt).
    languages: list[str] = Field(default_factory=list)
    keywords: list[str] = Field(default_factory=list)
    # OpenAI's include[]: "logprobs" gives each text token's log-probability (json only).
    include: list[Literal["logprobs"]] = Field(default_factory=list)
    max_completion_tokens: int | None = Field(None, ge=1)
    seed: int | None = Field(None, ge=MIN_SEED, le=MAX_SEED)
    # asrserve's extension (OpenAI SDK: extra_body={"temperature_fallback": False}): at
    # temperature 0, decode once instead of retrying failed pieces at higher temperatures.
    temperature_fallback: bool = True
    # asrserve's extension: samples drawn at each temperature above 0, the likeliest kept
    # (openai/whisper's best_of). Default 5, as openai/whisper's command line and faster-whisper.
    best_of: int | None = Field(None, ge=1, le=MAX_BEST_OF)
    # "auto", or {"type": "server_vad", ...}: a JSON object in one field, or its fields sent as
    # chunking_strategy[type], chunking_strategy[threshold], ... (as OpenAI's SDKs send objects).
    # Checked by asrserve.audio.chunking.ChunkingStrategy.parse.
    chunking_strategy: str | dict[str, str] | None = None
    # asrserve's extension, for benchmarks (as vLLM's ignore_eos): never stop at
    # <|endoftext|>; each piece decodes max_completion_tokens tokens (224 when not given).
    ignore_eos: bool = False

    @classmethod
    def from_form(cls, fields: dict[str, list[str]]) -> "TranscriptionRequest":
        """Validates multipart fields; the first problem becomes a 400 naming its field."""
        values: dict[str, Any] = {}
        for name, items in fields.items():
            key = name.removesuffix("[]")
            items = [item for item in items if item != ""]  # an empty field means "not given"
            if not items:
                continue
            if key in DIARIZATION_FIELDS:  # ignored, a client would take the transcript for a diarized one
                raise APIError(400, f"{key}: speaker diarization is not available: asrserve serves Whisper "
                               "models (OpenAI's field is for gpt-4o-transcribe-diarize)", param=key)
            if key.startswith("chunking_strategy[") and key.endswith("]"):
                strategy = values.setdefault("chunking_strategy", {})
                if isinstance(strategy, dict):
                    strategy[key[len("chunking_strategy[") : -1]] = items[-1]
            elif key in ("timestamp_granularities", "include", "languages", "keywords"):
                values.setdefault(key, []).extend(items)
            else:
                values[key] = items[-1]
        try:
            request = cls.model_validate(values)
        except ValidationError as error:
            raise validation_error(error.errors()) from None
        return request

    @property
    def prompt_head(self) -> str | None:
        return keywords_text(self.keywords)


def keywords_text(keywords: Sequence[str]) -> str | None:
    """OpenAI's keywords as the list its guide asks a Whisper prompt to be ("ZyntriQix, Digique
    Plus"): read in front of the prompt (the prompt nearest the audio), and kept whole where
    the prompt is cut to fit (EngineCore.add_request's prompt_head)."""
    return ", ".join(filter(None, (" ".join(keyword.split()) for keyword in keywords))) or None


def validation_error(errors) -> APIError:
    """The first of pydantic's (or FastAPI's) validation errors, as a 400 naming its field."""
    first = errors[0]
    location = [str(part) for part in first.get("loc", ()) if part not in ("body", "query", "path", "header")]
    param = location[0] if location else None
    message = f"{param}: {first.get('msg', 'invalid')}" if param else first.get("msg", "invalid request")
    if first["type"] == "literal_error" and param == "response_format":  # ours name their field
        message = f"response_format must be one of {', '.join(RESPONSE_FORMATS)}"
    elif first["type"] == "literal_error" and param == "timestamp_granularities":
        message = "timestamp_granularities[] must be 'word' or 'segment'"
    elif first["type"] == "literal_error" and param == "include":
        message = "include[] may only be 'logprobs'"
    return APIError(400, message, param=param)


def usage_duration(seconds: float) -> dict[str, Any]:
    return {"type": "duration", "seconds": round(seconds, 3)}


def usage_tokens(audio_tokens: int, text_tokens: int, output_tokens: int) -> dict[str, Any]:
    """OpenAI's token usage: the input is audio (encoder positions) and text (the prompt)."""
    return {
        "type": "tokens",
        "input_tokens": audio_tokens + text_tokens,
        "input_token_details": {"audio_tokens": audio_tokens, "text_tokens": text_tokens},
        "output_tokens": output_tokens,
        "total_tokens": audio_tokens + text_tokens + output_tokens,
    }
