"""The reference implementation for exactness tests: transformers' WhisperForConditionalGeneration
with greedy `generate` in fp32 on the CPU, on the same weights as the engine."""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import torch
from transformers import (
    GenerationConfig,
    WhisperConfig,
    WhisperFeatureExtractor,
    WhisperForConditionalGeneration,
)

from asrserve.model import ctranslate2
from asrserve.model.loader import _add_language_token, _bundled
from asrserve.model.tokenizer import SpecialTokens


def generation_config(vocab_size: int, suppress_tokens: list[int], begin_suppress_tokens: list[int]):
    special = SpecialTokens.for_vocab(vocab_size)
    multilingual = vocab_size >= 51865
    languages = {}
    if multilingual:  # with these, transformers would put language tokens in an .en prompt too
        languages = {
            "lang_to_id": {f"<|{code}|>": token for code, token in special.language_ids.items()},
            "task_to_id": {"transcribe": special.transcribe, "translate": special.translate},
        }
    return GenerationConfig(
        decoder_start_token_id=special.sot,
        eos_token_id=special.eot,
        pad_token_id=special.eot,
        suppress_tokens=suppress_tokens,
        begin_suppress_tokens=begin_suppress_tokens,
        no_timestamps_token_id=special.no_timestamps,
        is_multilingual=multilingual,
        max_length=448,
        **languages,
    )


def bundled_hf_model(short_name: str) -> tuple[WhisperForConditionalGeneration, GenerationConfig]:
    """A bundled CTranslate2 checkpoint converted into transformers' model."""
    checkpoint = _bundled(short_name)
    assert checkpoint is not None, f"bundled {short_name} is not installed"
    variables, config = ctranslate2.read_checkpoint(checkpoint.directories)
    state_dict = {k: v.float() for k, v in ctranslate2.to_hf_state_dict(variables).items()}
    d_model = state_dict["model.encoder.conv1.weight"].shape[0]
    vocab_size = state_dict["model.decoder.embed_tokens.weight"].shape[0]
    layers = 1 + max(int(k.split(".")[3]) for k in state_dict if k.startswith("model.encoder.layers."))
    special = SpecialTokens.for_vocab(vocab_size)
    hf_config = WhisperConfig(
        vocab_size=vocab_size,
        num_mel_bins=state_dict["model.encoder.conv1.weight"].shape[1],
        d_model=d_model,
        encoder_layers=layers,
        decoder_layers=layers,
        encoder_attention_heads=int(variables["encoder/num_heads"]),
        decoder_attention_heads=int(variables["decoder/num_heads"]),
        encoder_ffn_dim=4 * d_model,
        decoder_ffn_dim=4 * d_model,
        decoder_start_token_id=special.sot,
        eos_token_id=special.eot,
        pad_token_id=special.eot,
        bos_token_id=special.eot,
    )
    model = WhisperForConditionalGeneration(hf_config)
    state_dict["proj_out.weight"] = state_dict["model.decoder.embed_tokens.weight"]
    model.load_state_dict(state_dict)
    return model.eval(), generation_config(vocab_size, config["suppress_ids"], config["suppress_ids_begin"])


def save_random_checkpoint(path: Path, vocab_size: int, n_mels: int = 80, seed: int = 0):
    """A small random Whisper in Hugging Face's layout (config, safetensors, tokenizer,
    generation config). init_std 0.3 makes the output depend on the audio."""
    torch.manual_seed(seed)
    special = SpecialTokens.for_vocab(vocab_size)
    suppress = [1, 2, 7, 8, 9, 10, 14, 25, special.translate, special.transcribe, special.sot, special.sot_prev]
    # Random weights emit timestamp tokens even after <|notimestamps|>, and transformers'
    # generate then splits the output into segments and decodes past max_new_tokens: greedy
    # decoding is only comparable without them. (Real checkpoints do not emit them there.)
    suppress += list(range(special.timestamp_begin, vocab_size))
    config = WhisperConfig(
        vocab_size=vocab_size,
        num_mel_bins=n_mels,
        d_model=64,
        encoder_layers=2,
        decoder_layers=2,
        encoder_attention_heads=4,
        decoder_attention_heads=4,
        encoder_ffn_dim=256,
        decoder_ffn_dim=256,
        decoder_start_token_id=special.sot,
        eos_token_id=special.eot,
        pad_token_id=special.eot,
        bos_token_id=special.eot,
        suppress_tokens=suppress,
        begin_suppress_tokens=[220, special.eot],
        init_std=0.3,
    )
    model = WhisperForConditionalGeneration(config).eval()
    model.generation_config = generation_config(vocab_size, suppress, [220, special.eot])
    model.save_pretrained(path)
    text = _borrowed_tokenizer(vocab_size >= 51865)
    if vocab_size > 51865:
        text = _add_language_token(text, "yue")
    (path / "tokenizer.json").write_text(text)
    return model


def _borrowed_tokenizer(multilingual: bool) -> str:
    """A bundled package's tokenizer.json; where the packages cannot be installed (a GPU machine
    without a registry), $ASRSERVE_TEST_TOKENIZERS/{multilingual,en}.json."""
    source = _bundled("base" if multilingual else "tiny.en")
    if source is not None:
        tokenizer_dir = next(d for d in source.directories if (d / "tokenizer.json").is_file())
        return (tokenizer_dir / "tokenizer.json").read_text()
    folder = os.environ.get("ASRSERVE_TEST_TOKENIZERS")
    assert folder, "random checkpoints borrow a bundled tokenizer (or one in $ASRSERVE_TEST_TOKENIZERS)"
    return (Path(folder) / ("multilingual.json" if multilingual else "en.json")).read_text()


def hf_greedy(
    model: WhisperForConditionalGeneration,
    generation: GenerationConfig,
    audios: list[np.ndarray],
    language: str | None = None,
    max_new_tokens: int = 224,
    batch_size: int = 8,
) -> list[list[int]]:
    """Greedy tokens per audio, without the prompt and without trailing <|endoftext|>."""
    extractor = WhisperFeatureExtractor(feature_size=model.config.num_mel_bins)
    results = []
    for start in range(0, len(audios), batch_size):
        features = extractor(audios[start:start + batch_size], sampling_rate=16000, return_tensors="pt").input_features
        features = features.to(model.device, model.dtype)
        kwargs = {"language": language, "task": "transcribe"} if generation.is_multilingual else {}
        with torch.inference_mode():
            out = model.generate(
                features, generation_config=generation, return_timestamps=False,
                max_new_tokens=max_new_tokens, **kwargs,
            )
        results.extend(strip_eot(row.tolist(), generation.eos_token_id) for row in out)
    return results


def hf_detect_language(model, generation: GenerationConfig, audios: list[np.ndarray]) -> list[int]:
    extractor = WhisperFeatureExtractor(feature_size=model.config.num_mel_bins)
    features = extractor(audios, sampling_rate=16000, return_tensors="pt").input_features
    with torch.inference_mode():
        return model.detect_language(features, generation_config=generation).tolist()


def engine_tokens(engine, audios, language=None, max_tokens=None, prefix="r", **params) -> list[list[int]]:
    """The engine's output tokens for each audio (requests prefix0, prefix1, ...), run to
    completion together, without the trailing <|endoftext|>: what hf_greedy's are compared to."""
    from asrserve.engine.request import SamplingParams
    from tests.conftest import run_to_completion

    for i, audio in enumerate(audios):
        engine.add_request(f"{prefix}{i}", audio, language=language,
                           sampling_params=SamplingParams(max_tokens=max_tokens, **params))
    tokens = run_to_completion(engine)
    return [strip_eot(tokens[f"{prefix}{i}"], engine.tokenizer.special.eot) for i in range(len(audios))]


def strip_eot(tokens: list[int], eot: int) -> list[int]:
    while tokens and tokens[-1] == eot:
        tokens = tokens[:-1]
    return tokens
