"""What temperature fallback costs one request: the latency of clips on which fallback runs,
with OpenAI's defaults against `temperature_fallback=false`, one request at a time.

    python benchmarks/fallback_latency.py [--repeats 5] [--save-result fallback_latency.json]

The clips are benchmarks/workloads.mixed_clips. Offline, with OpenAI's defaults, each clip's
pieces report how many samples they decoded; the clips that needed fallback are then sent to
`asrserve serve` (tiny.en) at concurrency 1, each --repeats times in each mode, and the median
latency is reported. A clip on which every temperature fails decodes 1 + 5 x best_of samples.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import tempfile
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asrserve import ASR
from asrserve.benchmark.wer import corpus_wer, english_normalizer
from benchmarks.workloads import mixed_clips
from tests.server_utils import ServerProcess


def samples_decoded(directory: Path, names: list[str]) -> dict[str, int]:
    asr = ASR("tiny.en", dtype="float32")
    results = asr.transcribe([str(directory / name) for name in names])
    return {name: sum(p.summary.num_attempts for p in r.pieces) for name, r in zip(names, results)}


def latency(server: ServerProcess, path: Path, fields: dict, repeats: int) -> tuple[float, str]:
    times, text = [], ""
    for _ in range(repeats + 1):  # the first is a warm-up
        start = time.perf_counter()
        response = httpx.post(f"{server.url}/v1/audio/transcriptions", files={"file": path.read_bytes()},
                              data=fields, timeout=300)
        response.raise_for_status()
        times.append(time.perf_counter() - start)
        text = response.json()["text"]
    return statistics.median(times[1:]), text


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--save-result", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        directory = Path(tmp)
        references = mixed_clips(directory)
        counts = samples_decoded(directory, list(references))
        fell_back = {name: n for name, n in counts.items() if n > 1}
        print(f"{len(fell_back)} of {len(counts)} clips fell back: {fell_back}", flush=True)
        server = ServerProcess(["--dtype", "float32"])
        rows = []
        try:
            server.wait_ready()
            for name, count in sorted(fell_back.items(), key=lambda item: -item[1]):
                on, text_on = latency(server, directory / name, {}, args.repeats)
                off, text_off = latency(server, directory / name, {"temperature_fallback": "false"}, args.repeats)
                normalizer = english_normalizer()
                rows.append({
                    "clip": name, "samples_decoded": count, "latency_fallback_s": round(on, 3),
                    "latency_once_s": round(off, 3), "ratio": round(on / off, 2),
                    "wer_fallback": corpus_wer([references[name]], [text_on], normalizer),
                    "wer_once": corpus_wer([references[name]], [text_off], normalizer),
                })
                print(json.dumps(rows[-1]), flush=True)
        finally:
            server.stop()
    if args.save_result:
        args.save_result.write_text(json.dumps({
            "cpus": os.cpu_count(), "machine": platform.processor() or platform.machine(),
            "repeats": args.repeats, "rows": rows,
        }, indent=2) + "\n")


if __name__ == "__main__":
    main()
