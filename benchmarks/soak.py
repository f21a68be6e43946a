"""Soak: thousands of requests of mixed lengths and formats against one server. After warm-up,
resident memory must not creep (under 5% growth), and when the load stops the engine must
hold nothing: no KV blocks, no encoder outputs, no requests.

    python benchmarks/soak.py [--requests 2000] [--concurrency 16] [--segment 100] [--warmup 400]
                              [--save-result soak.json]

`asrserve serve` (default settings) runs as a subprocess. The requests go in segments of
--segment at --concurrency; the segments take turns at json, verbose_json with word
timestamps, streaming (SSE) and srt. The audio cycles through short spoken sentences (~2.5 s),
half-minute recordings and 1-2 minute recordings (real speech from ../shared/audio; espeak-ng
sentences without it). After each segment the server tree's resident memory (server plus
engine process) and the engine's gauges are read from /proc and /metrics.

Warm-up is one pass through every mode (4 segments): until each code path has run at full
concurrency, the high-water marks of its buffers and of the allocator's arenas still rise.
Growth is the largest resident size after warm-up over the size at its end.
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
from asrserve.benchmark.workload import load_workload
from benchmarks.overload import engine_idle
from benchmarks.workloads import long_recordings, short_clips, write_manifest
from tests.server_utils import ServerProcess

# (response_format, stream, extra fields): the segments take turns.
MODES = [
    ("json", False, ()),
    ("verbose_json", False, (("timestamp_granularities[]", "word"), ("timestamp_granularities[]", "segment"))),
    ("json", True, ()),
    ("srt", False, ()),
]


def mixed_workload(directory: Path, long_audio: bool = True) -> list:
    """Short clips, with half-minute and 1-2 minute recordings spread among them."""
    references = short_clips(12, directory)
    if long_audio:
        for index, (name, text) in enumerate(long_recordings(2, 25, directory).items()):
            (directory / name).rename(directory / f"half{index}.wav")
            references[f"half{index}.wav"] = text
        for index, (name, text) in enumerate(long_recordings(2, 60 + 40 * index, directory).items()):
            (directory / name).rename(directory / f"long{index}.wav")
            references[f"long{index}.wav"] = text
    files = load_workload(directory, write_manifest(directory, references))
    short = [f for f in files if f.duration_s < 20]
    longer = [f for f in files if f.duration_s >= 20]
    mixed = []  # a longer file after every three short ones
    for index, file in enumerate(short):
        mixed.append(file)
        if index % 3 == 2 and longer:
            mixed.append(longer[(index // 3) % len(longer)])
    return mixed


def run_soak(num_requests: int, concurrency: int, segment: int, warmup: int, files: list,
             server_args: tuple[str, ...] = ()) -> dict:
    server = ServerProcess(list(server_args))
    timeline = []
    try:
        server.wait_ready()
        started = time.monotonic()
        sent = 0
        while sent < num_requests:
            response_format, stream, fields = MODES[(sent // segment) % len(MODES)]
            count = min(segment, num_requests - sent)
            # Each segment starts where the last left off in the file cycle.
            rotated = files[sent % len(files):] + files[: sent % len(files)]
            spec = LoadSpec(url=server.url, model="tiny.en", concurrency=concurrency, num_requests=count,
                            response_format=response_format, stream=stream, fields=fields, progress=False)
            summary = summarize(asyncio.run(run_load(spec, rotated)), rotated)
            sent += count
            timeline.append({
                "requests_done": sent, "mode": response_format + (" stream" if stream else ""),
                "failed": summary["failed"], "rtfx": summary["rtfx"],
                "audio_seconds": summary["audio_seconds"], "wall_seconds": summary["wall_seconds"],
                "health_p99_ms": summary["health"].get("p99"),
                "rss_mb": round(server.tree_rss_bytes() / 2**20, 1), "elapsed_s": round(time.monotonic() - started, 1),
                "first_errors": summary.get("first_errors"),
            })
            print(json.dumps(timeline[-1]), flush=True)
        held_after = engine_idle(server)
        metrics = server.metrics()
    finally:
        server.stop()
    return {
        "requests": num_requests, "concurrency": concurrency, "segment": segment,
        **memory_growth(timeline, warmup),
        "failed": sum(point["failed"] for point in timeline),
        "audio_seconds": round(sum(point["audio_seconds"] for point in timeline), 1),
        "wall_seconds": round(sum(point["wall_seconds"] for point in timeline), 1),
        "engine_held_after": held_after,
        "kv_blocks_total": metrics["asrserve_kv_cache_blocks_total"],
        "preemptions": metrics["asrserve_preemptions_total"],
        "timeline": timeline,
    }


def memory_growth(timeline: list[dict], warmup: int) -> dict:
    """Resident memory at the end of warm-up, its largest value after, and the growth."""
    warm = [point for point in timeline if point["requests_done"] >= warmup] or timeline[-1:]
    baseline = warm[0]["rss_mb"]
    peak = max(point["rss_mb"] for point in warm[1:] or warm)
    return {
        "warmup_requests": warmup, "rss_mb_after_warmup": baseline, "rss_mb_max_after_warmup": peak,
        "rss_mb_end": timeline[-1]["rss_mb"], "rss_growth_after_warmup": round(peak / baseline - 1, 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=2000)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--segment", type=int, default=100, help="requests per segment (one mode each)")
    parser.add_argument("--warmup", type=int, default=None,
                        help="requests before the memory baseline (default: one segment of each mode)")
    parser.add_argument("--save-result", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        files = mixed_workload(Path(tmp))
    warmup = args.warmup if args.warmup is not None else args.segment * len(MODES)
    result = run_soak(args.requests, args.concurrency, args.segment, warmup, files)
    result["machine"] = {"cpu": platform.processor() or platform.machine(), "python": platform.python_version()}
    summary = {key: value for key, value in result.items() if key != "timeline"}
    print(json.dumps(summary, indent=2))
    if args.save_result:
        args.save_result.write_text(json.dumps(result, indent=2) + "\n")
    held = any(result["engine_held_after"].values())
    sys.exit(1 if result["failed"] or held or result["rss_growth_after_warmup"] >= 0.05 else 0)


if __name__ == "__main__":
    main()
