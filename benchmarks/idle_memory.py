"""Resident memory of each server process once idle, burst after burst of mixed work.

    python benchmarks/idle_memory.py [--rounds 3] [--requests 48] [--concurrency 16] [--save-result F]

`asrserve serve` (default settings) runs as a subprocess. Each round sends one burst in each of
benchmarks/soak.py's modes (json, verbose_json with word and segment times, streamed, srt) over
its mixed workload (short sentences, half-minute and 1-2 minute recordings), and after each
burst waits until the engine holds nothing and both processes have been idle past their idle
time, then reads the API process's and the engine process's resident memory from /proc. A
server that hands its freed heap back once idle starts every burst from about the same figure;
one that does not ratchets up to its arenas' high-water marks.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import platform
import sys
import tempfile
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asrserve.benchmark.load_generator import LoadSpec, run_load
from asrserve.benchmark.report import summarize
from benchmarks.overload import settle
from benchmarks.soak import MODES, mixed_workload
from tests.server_utils import ServerProcess

IDLE_WAIT_S = 3.0  # past both processes' idle time (1 s each) and one period of the server's watch


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024


def run(rounds: int, requests: int, concurrency: int, files: list, server_args: tuple[str, ...] = ()) -> dict:
    server = ServerProcess(list(server_args))
    points = []
    try:
        server.wait_ready()
        api_pid, engine_pid = server.process.pid, server.engine_pid()
        points.append({"burst": 0, "mode": "start", "api_mb": round(rss_mb(api_pid), 1),
                       "engine_mb": round(rss_mb(engine_pid), 1)})
        for burst in range(1, rounds * len(MODES) + 1):
            response_format, stream, fields = MODES[(burst - 1) % len(MODES)]
            rotated = files[burst % len(files):] + files[: burst % len(files)]
            spec = LoadSpec(url=server.url, model="tiny.en", concurrency=concurrency, num_requests=requests,
                            response_format=response_format, stream=stream, fields=fields, progress=False)
            summary = summarize(asyncio.run(run_load(spec, rotated)), rotated)
            settle(server)
            time.sleep(IDLE_WAIT_S)
            points.append({"burst": burst, "mode": response_format + (" stream" if stream else ""),
                           "failed": summary["failed"], "api_mb": round(rss_mb(api_pid), 1),
                           "engine_mb": round(rss_mb(engine_pid), 1)})
            print(json.dumps(points[-1]), flush=True)
    finally:
        server.stop()
    after_warmup = points[len(MODES):]  # from the end of the first round: every mode has run
    return {
        "rounds": rounds, "requests_per_burst": requests, "concurrency": concurrency,
        "failed": sum(point.get("failed", 0) for point in points),
        "api_mb_start": points[0]["api_mb"],
        "api_mb_idle_after_first_round": after_warmup[0]["api_mb"],
        "api_mb_idle_max": max(point["api_mb"] for point in after_warmup),
        "api_mb_idle_last": points[-1]["api_mb"],
        "engine_mb_idle_max": max(point["engine_mb"] for point in after_warmup),
        "points": points,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3, help="rounds of one burst per mode")
    parser.add_argument("--requests", type=int, default=48, help="requests per burst")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--save-result", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = mixed_workload(Path(tmp))
    result = run(args.rounds, args.requests, args.concurrency, files)
    result["machine"] = {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()}
    print(json.dumps({key: value for key, value in result.items() if key != "points"}, indent=2))
    if args.save_result:
        args.save_result.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
