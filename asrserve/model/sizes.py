"""The standard Whisper sizes: short names, hub repositories and architectures."""

from __future__ import annotations

import json
from pathlib import Path

from asrserve.errors import ModelLoadError
from asrserve.model.whisper import WhisperDims

ENGLISH_VOCAB, MULTILINGUAL_VOCAB, V3_VOCAB = 51864, 51865, 51866

# name -> (d_model, heads, encoder layers, decoder layers, mel bins, vocabulary)
_SIZES = {
    "tiny.en": (384, 6, 4, 4, 80, ENGLISH_VOCAB),
    "tiny": (384, 6, 4, 4, 80, MULTILINGUAL_VOCAB),
    "base.en": (512, 8, 6, 6, 80, ENGLISH_VOCAB),
    "base": (512, 8, 6, 6, 80, MULTILINGUAL_VOCAB),
    "small.en": (768, 12, 12, 12, 80, ENGLISH_VOCAB),
    "small": (768, 12, 12, 12, 80, MULTILINGUAL_VOCAB),
    "medium.en": (1024, 16, 24, 24, 80, ENGLISH_VOCAB),
    "medium": (1024, 16, 24, 24, 80, MULTILINGUAL_VOCAB),
    "large-v1": (1280, 20, 32, 32, 80, MULTILINGUAL_VOCAB),
    "large-v2": (1280, 20, 32, 32, 80, MULTILINGUAL_VOCAB),
    "large-v3": (1280, 20, 32, 32, 128, V3_VOCAB),
    "large-v3-turbo": (1280, 20, 32, 4, 128, V3_VOCAB),
}
_ALIASES = {"large": "large-v3", "turbo": "large-v3-turbo"}

# Hub repositories of OpenAI's checkpoints (HF format).
HUB_REPOS = {name: f"openai/whisper-{name}" for name in _SIZES} | {"large-v1": "openai/whisper-large"}

SHORT_NAMES = sorted([*_SIZES, *_ALIASES])


def canonical_name(name: str) -> str | None:
    """'turbo' -> 'large-v3-turbo', 'openai/whisper-base' -> 'base'; None if not a standard size."""
    name = name.strip().lower()
    if name.startswith("openai/whisper-"):
        stem = name.removeprefix("openai/whisper-")
        return "large-v1" if stem == "large" else (stem if stem in _SIZES else None)
    name = _ALIASES.get(name.removeprefix("whisper-"), name.removeprefix("whisper-"))
    return name if name in _SIZES else None


def standard_dims(name: str) -> WhisperDims:
    d_model, heads, encoder_layers, decoder_layers, n_mels, vocab = _SIZES[name]
    return WhisperDims(
        n_mels=n_mels,
        n_audio_ctx=1500,
        n_audio_state=d_model,
        n_audio_head=heads,
        n_audio_layer=encoder_layers,
        n_vocab=vocab,
        n_text_ctx=448,
        n_text_state=d_model,
        n_text_head=heads,
        n_text_layer=decoder_layers,
    )


def read_json(path: Path) -> dict:
    try:
        return json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ModelLoadError(f"{path} is not valid JSON: {error}") from None


def dims_from_hf_config(config: dict, path: Path) -> WhisperDims:
    """A Hugging Face config.json's architecture (transformers' defaults where a key is absent,
    but the vocabulary's size, which decides the special tokens)."""
    if "vocab_size" not in config:
        raise ModelLoadError(f"{path} has no vocab_size")
    d_model = config.get("d_model", 1280)
    return WhisperDims(
        n_mels=config.get("num_mel_bins", 80),
        n_audio_ctx=config.get("max_source_positions", 1500),
        n_audio_state=d_model,
        n_audio_head=config.get("encoder_attention_heads", 20),
        n_audio_layer=config.get("encoder_layers", 32),
        n_vocab=config["vocab_size"],
        n_text_ctx=config.get("max_target_positions", 448),
        n_text_state=d_model,
        n_text_head=config.get("decoder_attention_heads", 20),
        n_text_layer=config.get("decoder_layers", 32),
    )
