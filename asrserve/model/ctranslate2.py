"""Reads CTranslate2 Whisper checkpoints (how faster-whisper users keep their models).

model.bin is a flat list of named arrays (see the layout below); we read it with numpy and
rename the arrays into Hugging Face's Whisper layout, so every source reaches the model through
one state-dict format.
"""

from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import torch

from asrserve.model.sizes import read_json

# CTranslate2's dtype codes.
_DTYPES = {
    0: np.float32,
    1: np.int8,
    2: np.int16,
    3: np.int32,
    4: np.float16,
    5: np.uint16,  # bfloat16: raw bits, widened below
}


class CheckpointFormatError(ValueError):
    """The file is not a readable CTranslate2 Whisper checkpoint."""


class _Reader:
    def __init__(self, data: bytes | bytearray):
        self.data = data
        self.offset = 0

    def take(self, fmt: str):
        size = struct.calcsize("<" + fmt)
        if self.offset + size > len(self.data):
            raise CheckpointFormatError("model.bin ends early (truncated file?)")
        (value,) = struct.unpack_from("<" + fmt, self.data, self.offset)
        self.offset += size
        return value

    def string(self) -> str:
        length = self.take("H")
        raw = self.data[self.offset:self.offset + length]
        self.offset += length
        return raw.rstrip(b"\0").decode("utf-8")

    def raw(self, num_bytes: int) -> memoryview:
        if self.offset + num_bytes > len(self.data):
            raise CheckpointFormatError("model.bin ends early (truncated file?)")
        view = memoryview(self.data)[self.offset:self.offset + num_bytes]
        self.offset += num_bytes
        return view


def read_model_bin(data: bytes | bytearray) -> dict[str, np.ndarray]:
    """Parses model.bin: version, spec name, revision, variables, then aliases."""
    reader = _Reader(data)
    version = reader.take("I")
    if version < 5 or version > 6:
        raise CheckpointFormatError(f"unsupported CTranslate2 model.bin version {version}")
    spec = reader.string()
    if spec != "WhisperSpec":
        raise CheckpointFormatError(f"model.bin holds a {spec or 'unnamed'} model, not Whisper")
    reader.take("I")  # spec revision
    variables: dict[str, np.ndarray] = {}
    for _ in range(reader.take("I")):
        name = reader.string()
        rank = reader.take("B")
        shape = tuple(reader.take("I") for _ in range(rank))
        dtype_code = reader.take("B")
        num_bytes = reader.take("I")
        if dtype_code not in _DTYPES:
            raise CheckpointFormatError(f"variable {name} has unknown dtype code {dtype_code}")
        array = np.frombuffer(reader.raw(num_bytes), dtype=_DTYPES[dtype_code])
        if array.size != int(np.prod(shape)):
            raise CheckpointFormatError(f"variable {name}: {array.size} values for shape {shape}")
        if dtype_code == 5:
            array = (array.astype(np.uint32) << 16).view(np.float32)
        variables[name] = array.reshape(shape)
    for _ in range(reader.take("I")):
        alias, target = reader.string(), reader.string()
        variables[alias] = variables[target]
    return variables


def _dequantize(variables: dict[str, np.ndarray], name: str) -> np.ndarray:
    weight = variables[name]
    scale_name = name[: -len("weight")] + "weight_scale"
    if weight.dtype in (np.int8, np.int16) and scale_name in variables:
        scale = variables[scale_name].astype(np.float32)
        return weight.astype(np.float32) / scale.reshape(-1, *([1] * (weight.ndim - 1)))
    return weight


def _split(array: np.ndarray, parts: int) -> list[np.ndarray]:
    return np.split(array, parts, axis=0)


def to_hf_state_dict(variables: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    """Renames CTranslate2 Whisper variables into Hugging Face's Whisper parameter names."""
    out: dict[str, np.ndarray] = {}

    def linear(src: str, dst: str) -> None:
        out[f"{dst}.weight"] = _dequantize(variables, f"{src}/weight")
        out[f"{dst}.bias"] = variables[f"{src}/bias"]

    def norm(src: str, dst: str) -> None:
        out[f"{dst}.weight"] = variables[f"{src}/gamma"]
        out[f"{dst}.bias"] = variables[f"{src}/beta"]

    def fused_qkv(src: str, dst: str) -> None:
        q_w, k_w, v_w = _split(_dequantize(variables, f"{src}/weight"), 3)
        q_b, _, v_b = _split(variables[f"{src}/bias"], 3)  # Whisper's k_proj has no bias
        out[f"{dst}.q_proj.weight"], out[f"{dst}.q_proj.bias"] = q_w, q_b
        out[f"{dst}.k_proj.weight"] = k_w
        out[f"{dst}.v_proj.weight"], out[f"{dst}.v_proj.bias"] = v_w, v_b

    def self_attention_and_ffn(src: str, dst: str) -> None:
        """The parts encoder and decoder layers share."""
        fused_qkv(f"{src}/self_attention/linear_0", f"{dst}.self_attn")
        linear(f"{src}/self_attention/linear_1", f"{dst}.self_attn.out_proj")
        norm(f"{src}/self_attention/layer_norm", f"{dst}.self_attn_layer_norm")
        linear(f"{src}/ffn/linear_0", f"{dst}.fc1")
        linear(f"{src}/ffn/linear_1", f"{dst}.fc2")
        norm(f"{src}/ffn/layer_norm", f"{dst}.final_layer_norm")

    try:
        for conv in ("conv1", "conv2"):
            out[f"model.encoder.{conv}.weight"] = _dequantize(variables, f"encoder/{conv}/weight")
            out[f"model.encoder.{conv}.bias"] = variables[f"encoder/{conv}/bias"]
        out["model.encoder.embed_positions.weight"] = variables["encoder/position_encodings/encodings"]
        norm("encoder/layer_norm", "model.encoder.layer_norm")
        for i in range(_count_layers(variables, "encoder")):
            self_attention_and_ffn(f"encoder/layer_{i}", f"model.encoder.layers.{i}")

        # Quantized too (per row, as a linear's weight) by `--quantization int8`: read raw, every
        # token's embedding and logit came out in steps of one (the text empty or "was was was").
        out["model.decoder.embed_tokens.weight"] = _dequantize(variables, "decoder/embeddings/weight")
        out["model.decoder.embed_positions.weight"] = variables["decoder/position_encodings/encodings"]
        norm("decoder/layer_norm", "model.decoder.layer_norm")
        for i in range(_count_layers(variables, "decoder")):
            src, dst = f"decoder/layer_{i}", f"model.decoder.layers.{i}"
            self_attention_and_ffn(src, dst)
            linear(f"{src}/attention/linear_0", f"{dst}.encoder_attn.q_proj")
            k_w, v_w = _split(_dequantize(variables, f"{src}/attention/linear_1/weight"), 2)
            _, v_b = _split(variables[f"{src}/attention/linear_1/bias"], 2)
            out[f"{dst}.encoder_attn.k_proj.weight"] = k_w
            out[f"{dst}.encoder_attn.v_proj.weight"], out[f"{dst}.encoder_attn.v_proj.bias"] = v_w, v_b
            linear(f"{src}/attention/linear_2", f"{dst}.encoder_attn.out_proj")
            norm(f"{src}/attention/layer_norm", f"{dst}.encoder_attn_layer_norm")
    except KeyError as missing:
        raise CheckpointFormatError(f"model.bin lacks the Whisper variable {missing}") from None
    return {name: torch.from_numpy(np.ascontiguousarray(array)) for name, array in out.items()}


def _count_layers(variables: dict[str, np.ndarray], stack: str) -> int:
    pattern = re.compile(rf"^{stack}/layer_(\d+)/")
    indices = {int(m.group(1)) for name in variables if (m := pattern.match(name))}
    if not indices or indices != set(range(len(indices))):
        raise CheckpointFormatError(f"model.bin has no complete {stack} layer stack")
    return len(indices)


def num_heads(variables: dict[str, np.ndarray], stack: str) -> int | None:
    value = variables.get(f"{stack}/num_heads")
    return int(value.reshape(-1)[0]) if value is not None else None


def model_bin_parts(directories: list[Path]) -> list[Path]:
    """model.bin, or its pieces model.bin.part1, .part2, ... gathered over several directories
    (a split checkpoint can ship its parts in separate packages), in part order."""
    for directory in directories:
        if (directory / "model.bin").is_file():
            return [directory / "model.bin"]
    parts = [p for d in directories for p in d.glob("model.bin.part*")]
    return sorted(parts, key=lambda p: int(p.suffix.removeprefix(".part") or 0))


def read_checkpoint(directories: list[Path]) -> tuple[dict[str, np.ndarray], dict]:
    """Reads the (possibly split) model.bin and the first config.json of the directories."""
    parts = model_bin_parts(directories)
    if not parts:
        raise CheckpointFormatError(f"{directories[0]} has no model.bin")
    numbers = [int(p.suffix.removeprefix(".part") or 0) for p in parts if p.name != "model.bin"]
    if numbers and numbers != list(range(1, len(numbers) + 1)):
        raise CheckpointFormatError(f"model.bin parts are incomplete: found parts {numbers}")
    data = bytearray()  # writable, so tensors may share its memory
    for part in parts:
        data += part.read_bytes()
    config: dict = {}
    for directory in directories:
        if (directory / "config.json").is_file():
            config = read_json(directory / "config.json")
            break
    return read_model_bin(data), config


def is_checkpoint_dir(path: Path) -> bool:
    return bool(model_bin_parts([path]))
