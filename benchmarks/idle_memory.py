"""Resident memory of each server process once idle, burst after burst of mixed work.

    python benchmarks/idle_memory.py [--rounds 3] [--requests 48] [--concurrency 16] [--save-result F]
    python benchmarks/idle_memory.py --distinct-lengths 240 [--requests 48] [--save-result F]

`asrserve serve` (default settings) runs as a subprocess. Each round sends one burst in each of
benchmarks/soak.py's modes (json, verbose_json with word and segment times, streamed, srt) over
its mixed workload (short sentences, half-minute and 1-2 minute recordings), and after each
burst waits until the engine holds nothing and both processes have been idle past their idle
time, then reads the API process's and the engine process's resident memory from /proc. A
server that hands its freed heap back once idle starts every burst from about the same figure;
one that does not ratchets up to its arenas' high-water marks.

With --distinct-lengths N, the bursts (json) send N recordings instead, from 31 s up, each cut
to a number of VAD windows no other has: a cache keyed by an audio's length (the VAD's LSTM once had one, in
oneDNN) grows with every new length, which a workload of a few fixed files never shows.
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

import soundfile

from asrserve.benchmark.load_generator import LoadSpec, run_load
from asrserve.benchmark.report import summarize
from asrserve.benchmark.workload import load_workload
from asrserve.config import SAMPLE_RATE
from benchmarks.overload import settle
from benchmarks.soak import MODES, mixed_workload
from benchmarks.workloads import long_recordings, write_manifest
from tests.server_utils import ServerProcess

IDLE_WAIT_S = 3.0  # past both processes' idle time (1 s each) and one period of the server's watch


def rss_mb(pid: int) -> float:
    status = Path(f"/proc/{pid}/status").read_text()
    return int(next(line.split()[1] for line in status.splitlines() if line.startswith("VmRSS:"))) / 1024


def distinct_lengths_workload(directory: Path, count: int) -> list:
    """`count` cuts of one recording (real speech, or espeak-ng sentences without
    ../shared/audio) from 31 s up, each one VAD window (32 ms) longer than the last."""
    window = 512
    name = next(iter(long_recordings(1, 31 + count * window / SAMPLE_RATE, directory)))
    audio, _ = soundfile.read(directory / name, dtype="float32")
    references = {}
    for index in range(count):
        cut = f"cut{index:04d}.wav"
        soundfile.write(directory / cut, audio[: 31 * SAMPLE_RATE + index * window], SAMPLE_RATE)
        references[cut] = ""  # memory only: no reference text for a cut
    return load_workload(directory, write_manifest(directory, references))


def run_distinct(requests: int, concurrency: int, files: list, server_args: tuple[str, ...] = ()) -> dict:
    """Bursts of `requests` json transcriptions, every file sent once, memory read when idle."""
    server = ServerProcess(list(server_args))
    points = []
    try:
        server.wait_ready()
        api_pid, engine_pid = server.process.pid, server.engine_pid()
        points.append({"sent": 0, "api_mb": round(rss_mb(api_pid), 1), "engine_mb": round(rss_mb(engine_pid), 1)})
        for start in range(0, len(files), requests):
            burst = files[start : start + requests]
            spec = LoadSpec(url=server.url, model="tiny.en", concurrency=concurrency, num_requests=len(burst),
                            response_format="json", progress=False)
            summary = summarize(asyncio.run(run_load(spec, burst)), burst)
            settle(server)
            time.sleep(IDLE_WAIT_S)
            points.append({"sent": start + len(burst), "failed": summary["failed"],
                           "api_mb": round(rss_mb(api_pid), 1), "engine_mb": round(rss_mb(engine_pid), 1)})
            print(json.dumps(points[-1]), flush=True)
    finally:
        server.stop()
    return {
        "distinct_lengths": len(files), "requests_per_burst": requests, "concurrency": concurrency,
        "failed": sum(point.get("failed", 0) for point in points),
        "api_mb_start": points[0]["api_mb"], "api_mb_after_first_burst": points[1]["api_mb"],
        "api_mb_idle_last": points[-1]["api_mb"], "engine_mb_idle_last": points[-1]["engine_mb"],
        "points": points,
    }


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
    parser.add_argument("--distinct-lengths", type=int, default=0,
                        help="send this many recordings of distinct lengths (json) instead of the mixed bursts")
    parser.add_argument("--save-result", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        if args.distinct_lengths:
            files = distinct_lengths_workload(Path(tmp), args.distinct_lengths)
        else:
            files = mixed_workload(Path(tmp))
    if args.distinct_lengths:
        result = run_distinct(args.requests, args.concurrency, files)
    else:
        result = run(args.rounds, args.requests, args.concurrency, files)
    result["machine"] = {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()}
    print(json.dumps({key: value for key, value in result.items() if key != "points"}, indent=2))
    if args.save_result:
        args.save_result.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
