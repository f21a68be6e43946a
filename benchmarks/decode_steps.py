"""The engine's decode step with the linears packed for oneDNN (the default on CPU) and without
(MKL, steps padded to 16 rows: how every step ran before packed_linear.py), in turns:

    python benchmarks/decode_steps.py [--dtype bfloat16] [--requests 1,8,32] [--rounds 3]

Each variant is a real `EngineCore` on tiny.en; n copies of jfk (11 s) are submitted at once and
the engine stepped until idle. A row is the median step after the first (which runs the
encoder), the lowest and highest over --rounds rounds taken in turns (this machine drifts).
Copies of one clip decode in lockstep, so every step holds all n requests.
"""

from __future__ import annotations

import argparse
import statistics
import time
from pathlib import Path

from asrserve.audio.decode import load_audio
from asrserve.config import CacheConfig, EngineConfig, ModelConfig, SchedulerConfig
from asrserve.engine.engine_core import EngineCore
from asrserve.worker import model_runner

JFK = Path(__file__).resolve().parents[2] / "shared" / "audio" / "openai-whisper__jfk.flac"


def engine(dtype: str, packed: bool, max_num_seqs: int) -> EngineCore:
    pack = model_runner.pack_decoder_linears
    if not packed:
        model_runner.pack_decoder_linears = lambda *args, **kwargs: False
    try:
        config = EngineConfig(model=ModelConfig(dtype=dtype), cache=CacheConfig(),
                              # every copy admitted in the first step, so that they decode in lockstep
                              scheduler=SchedulerConfig(max_num_seqs=max_num_seqs, max_encoder_batch=max_num_seqs))
        core = EngineCore(config)
    finally:
        model_runner.pack_decoder_linears = pack
    assert core.runner.linears_packed == packed, "this CPU's oneDNN kernel failed the start-up check"
    return core


def median_step_ms(core: EngineCore, audio, requests: int, tag: str) -> float:
    for i in range(requests):
        core.add_request(f"{tag}-{i}", audio)
    steps = []
    while core.has_work():
        start = time.perf_counter()
        core.step()
        steps.append(time.perf_counter() - start)
    return statistics.median(steps[1:]) * 1e3


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--dtype", default="auto", help="auto (bfloat16 where the CPU computes it), float32, bfloat16")
    parser.add_argument("--requests", default="1,8,32")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--audio", type=Path, default=JFK)
    args = parser.parse_args()
    requests = [int(n) for n in args.requests.split(",")]
    audio = load_audio(args.audio)
    variants = {"packed, unpadded (default)": True, "MKL, padded to 16 rows (before)": False}
    cores = {name: engine(args.dtype, packed, max(requests)) for name, packed in variants.items()}
    print(f"dtype {cores[next(iter(cores))].dtype}, {args.audio.name}")
    timings: dict[tuple[str, int], list[float]] = {}
    for round_index in range(args.rounds):
        for n in requests:
            for name, core in cores.items():
                if round_index == 0:  # oneDNN builds a kernel the first time it meets a row count
                    median_step_ms(core, audio, n, f"warm-{n}")
                timings.setdefault((name, n), []).append(median_step_ms(core, audio, n, f"r{round_index}-{n}"))
    print(f"{'requests':>8}  " + "".join(f"{name:>34}" for name in cores))
    for n in requests:
        cells = [timings[(name, n)] for name in cores]
        print(f"{n:>8}  " + "".join(f"{f'{min(c):.1f}-{max(c):.1f} ms':>34}" for c in cells))


if __name__ == "__main__":
    main()
