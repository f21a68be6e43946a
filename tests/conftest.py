"""Shared fixtures: synthetic speech, engines on the bundled tiny.en, random checkpoints."""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    # The CUDA decode-attention kernels (asrserve/model/decode_attention.py) run on CPU
    # through Triton's interpreter; set before any kernel is defined.
    os.environ.setdefault("TRITON_INTERPRET", "1")

from asrserve.audio.decode import load_audio
from asrserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from asrserve.worker.cpu_quota import usable_cpus
from benchmarks.workloads import have_espeak, speak

if (_workers := int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "0"))) and not os.environ.get("OMP_NUM_THREADS"):
    # pytest -n N (README): each worker, and every server and CLI it starts (they take
    # OMP_NUM_THREADS: cpu_quota), gets its share of the cores. A team of threads as large as
    # the machine in each worker oversubscribed it: the suite ran slower on 2 workers than on 1.
    os.environ["OMP_NUM_THREADS"] = str(max(1, usable_cpus() // _workers))
    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))

SHARED_AUDIO = Path(__file__).resolve().parents[2] / "shared" / "audio"

# Sixteen sentences of different lengths (Harvard sentences and friends).
SENTENCES = [
    "Hello.",
    "The quick brown fox jumps over the lazy dog.",
    "Please call Stella.",
    "Ask her to bring these things with her from the store.",
    "Six spoons of fresh snow peas, five thick slabs of blue cheese, and maybe a snack for her brother Bob.",
    "We also need a small plastic snake and a big toy frog for the kids.",
    "She can scoop these things into three red bags, and we will go meet her Wednesday at the train station.",
    "It is raining.",
    "The birch canoe slid on the smooth planks.",
    "Glue the sheet to the dark blue background.",
    "It is easy to tell the depth of a well.",
    "These days a chicken leg is a rare dish.",
    "Rice is often served in round bowls.",
    "The juice of lemons makes fine punch.",
    "The box was thrown beside the parked truck.",
    "The hogs were fed chopped corn and garbage, and the farmer counted them twice before sunset.",
]


def synthesize(text: str, path: Path, voice: str = "en-us") -> Path:
    return speak(text, path, voice)


def require_espeak() -> None:
    if not have_espeak():
        pytest.skip("espeak-ng is not installed (apt-get install espeak-ng)")


def require_ffmpeg() -> None:
    if shutil.which("ffmpeg") is None:
        pytest.skip("ffmpeg is not installed (apt-get install ffmpeg)")


@pytest.fixture(scope="session")
def speech_files(tmp_path_factory) -> list[Path]:
    """The sixteen sentences spoken by espeak-ng, as 22.05 kHz wav files."""
    require_espeak()
    directory = tmp_path_factory.mktemp("speech")
    return [synthesize(text, directory / f"clip{i:02d}.wav") for i, text in enumerate(SENTENCES)]


@pytest.fixture(scope="session")
def speech_audio(speech_files) -> list[np.ndarray]:
    return [load_audio(path) for path in speech_files]


def engine_config(model: str | None = None, **overrides) -> EngineConfig:
    cache = CacheConfig(**{k: overrides.pop(k) for k in ("block_size", "num_kv_blocks") if k in overrides})
    scheduler = SchedulerConfig(
        **{k: overrides.pop(k) for k in ("max_num_seqs", "max_encoder_batch", "encoder_cache_size") if k in overrides}
    )
    model_keys = ("dtype", "device", "load_format", "compile", "encoder_quantization", "enforce_eager")
    model_config = ModelConfig(model=model, **{k: overrides.pop(k) for k in model_keys if k in overrides})
    return EngineConfig(model=model_config, cache=cache, scheduler=scheduler, **overrides)


def decoding_request(name: str, num_computed: int, num_tokens: int, rng):
    """A request of num_tokens random prompt tokens, num_computed of them in the pool already,
    past its no-speech read: what a decoder step test puts in a batch by hand."""
    from asrserve.engine.request import Request, SamplingParams

    request = Request(name, np.zeros(16000, np.float32), [rng.randrange(1, 290) for _ in range(num_tokens)],
                      SamplingParams(), 10)
    request.num_computed_tokens = num_computed
    request.no_speech_prob = 0.0
    return request


def run_to_completion(engine, languages: dict[str, str] | None = None) -> dict[str, list[int]]:
    """Steps the engine until it is idle; the output tokens of every request by id (and into
    `languages`, each request's detected language)."""
    tokens: dict[str, list[int]] = {}
    while engine.has_work():
        for output in engine.step():
            tokens.setdefault(output.request_id, []).extend(output.new_token_ids)
            if output.language and languages is not None:
                languages[output.request_id] = output.language
    return tokens


@pytest.fixture(scope="session")
def tiny_en_engine():
    from asrserve.engine.engine_core import EngineCore

    return EngineCore(engine_config(dtype="float32"))
