"""The host's work in a CUDA decode step, timed on a CPU (issue 18: no per-request host work
per token).

On CUDA a pure decode step is one graph replay (asrserve/worker/cuda_graphs.py): ~3.6 ms of GPU
work at 256 running for large-v3-turbo on an H100. Whatever the host does around it adds to
that, since each step waits for its tokens. GPUs are scarce here, so this times the host's part
on a CPU: the engine on a small random model, its decode rows through DecodeGraphs.run's input
fill with the replay replaced by fixed logits, the sampler's torch path as on CUDA, and
--running requests decoding --tokens tokens each (EOS ignored, language given, no fallback).

It prints the median microseconds per step at full batch of schedule() (the scheduler), fill
(DecodeGraphs.run), update() (new tokens into the requests, stop checks, outputs) and the whole
step less the sampler, whose CPU arithmetic stands in for GPU work. Compare commits on one
machine in one sitting (from this one on: DecodeGraphs was CUDA-only before). 2026-11-27, 2 Zen
4 cores, 256 running: schedule() 572 µs with 2b8f315 reverted, 302 with it.

    python benchmarks/host_step.py [--running 256] [--tokens 90] [--rounds 3] [--profile FILE]
"""

from __future__ import annotations

import argparse
import cProfile
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asrserve.config import EngineConfig, ModelConfig, SchedulerConfig  # noqa: E402
from asrserve.engine.engine_core import EngineCore  # noqa: E402
from asrserve.engine.request import SamplingParams  # noqa: E402
from asrserve.worker import cpu_sampling  # noqa: E402
from asrserve.worker.cuda_graphs import DecodeGraphs  # noqa: E402
from tests.hf_reference import save_random_checkpoint  # noqa: E402

VOCAB = 51864  # tiny.en's, whose tokenizer is always installed; the host's work does not depend on it


class _NoReplay:
    def replay(self) -> None:
        pass


def host_only_graphs(runner, max_rows: int) -> DecodeGraphs:
    """The runner's DecodeGraphs, built on the CPU, each bucket's graph a no-op over fixed logits."""
    graphs = DecodeGraphs(runner.model, runner.kv_cache, runner.block_size, max_rows, runner.dims.n_text_ctx,
                          runner.decoder_inputs.cross_slot_tokens, runner.dims.n_audio_ctx, scratch_block=0)
    logits = torch.randn(max_rows, VOCAB, generator=torch.Generator().manual_seed(0))
    graphs.graphs = {bucket: (_NoReplay(), logits) for bucket in graphs.buckets}
    return graphs


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--running", type=int, default=256, help="max_num_seqs: requests decoding at once")
    parser.add_argument("--tokens", type=int, default=90, help="tokens each request decodes")
    parser.add_argument("--rounds", type=int, default=3, help="waves of 2x --running requests (the first is warm-up)")
    parser.add_argument("--profile", metavar="FILE", help="cProfile of the last round, written to FILE")
    args = parser.parse_args()
    torch.set_num_threads(1)
    cpu_sampling.available = lambda: False  # the sampler's torch path, as on CUDA

    with tempfile.TemporaryDirectory() as directory:
        save_random_checkpoint(Path(directory), VOCAB)
        engine = EngineCore(EngineConfig(
            model=ModelConfig(model=directory, dtype="float32", device="cpu"),
            scheduler=SchedulerConfig(max_num_seqs=args.running, max_encoder_batch=args.running),
        ))
    runner, scheduler = engine.runner, engine.scheduler
    runner.decode_graphs = host_only_graphs(runner, args.running)

    spent: dict[str, float] = {}

    def timed(name, function):
        def run(*call_args, **kwargs):
            started = time.perf_counter()
            try:
                return function(*call_args, **kwargs)
            finally:
                spent[name] = spent.get(name, 0.0) + time.perf_counter() - started
        return run

    scheduler.schedule = timed("schedule", scheduler.schedule)
    scheduler.update = timed("update", scheduler.update)
    runner.decode_graphs.run = timed("fill", runner.decode_graphs.run)
    runner.sampler = timed("sampler", runner.sampler)

    params = SamplingParams(max_tokens=args.tokens, ignore_eos=True)  # greedy, no fallback temperatures
    audio = (np.random.default_rng(0).standard_normal(16000) * 0.1).astype(np.float32)
    steps: list[dict[str, float]] = []
    profile = cProfile.Profile() if args.profile else None
    for round_index in range(args.rounds):
        for i in range(2 * args.running):
            engine.add_request(f"r{round_index}-{i}", audio, language="en", sampling_params=params)
        profiling = profile is not None and round_index == args.rounds - 1
        while engine.has_work():
            spent.clear()
            running = len(scheduler.running)
            if profiling:
                profile.enable()
            started = time.perf_counter()
            engine.step()
            spent["step"] = time.perf_counter() - started
            if profiling:
                profile.disable()
            # Pure decode steps at full batch, after the warm-up round.
            if round_index and running == args.running and "fill" in spent:
                steps.append(dict(spent))

    def median_us(value) -> float:
        return round(statistics.median(value(step) for step in steps) * 1e6, 1)

    result = {name: median_us(lambda step, name=name: step.get(name, 0.0)) for name in ("schedule", "fill", "update")}
    result["step_less_sampler"] = median_us(lambda step: step["step"] - step.get("sampler", 0.0))
    result["steps"] = len(steps)
    result["running"] = args.running
    print(json.dumps(result))
    if profile is not None:
        profile.dump_stats(args.profile)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
