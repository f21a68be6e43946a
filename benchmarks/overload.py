"""Overload: far more concurrent requests than the server takes. The excess must be refused at
once (429 with Retry-After, never a 5xx or a hang), everything accepted must succeed, memory
must stay bounded, and the server must be fully healthy afterwards.

    python benchmarks/overload.py [--requests 200] [--bursts 2] [--max-num-seqs 2] [--max-waiting-requests 8]
                                  [--save-result F]

`asrserve serve` runs as a subprocess with a small engine (--max-num-seqs) and a small waiting
bound (--max-waiting-requests); every request is sent at the same moment, one connection each,
each uploading a ~2.5 s spoken sentence. Resident memory of the server and its engine process
is sampled every 20 ms throughout. One audio per encoder forward (--max-encoder-batch 1): with
two, whether a burst's arrivals shared a forward moved its peak by 35-60 MB, timing rather than
growth, and the bursts' peaks are compared.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import threading
import time
from pathlib import Path

import httpx

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asrserve.engine.engine_process import IDLE_RELEASE_AFTER_S
from benchmarks.workloads import short_clips
from tests.server_utils import ServerProcess

ENGINE_HELD = ("asrserve_kv_cache_blocks_used", "asrserve_encoder_cache_entries", "asrserve_num_requests_running",
               "asrserve_num_requests_waiting", "asrserve_http_requests_waiting")


class MemorySampler(threading.Thread):
    """Samples the server tree's resident memory until stopped; keeps the peak."""

    def __init__(self, server: ServerProcess, interval_s: float = 0.02):
        super().__init__(daemon=True)
        self.server, self.interval_s = server, interval_s
        self.peak = server.tree_rss_bytes()
        self.done = threading.Event()

    def run(self) -> None:
        while not self.done.wait(self.interval_s):
            self.peak = max(self.peak, self.server.tree_rss_bytes())

    def stop(self) -> int:
        self.done.set()
        self.join()
        return self.peak


async def burst(url: str, audio: bytes, num_requests: int) -> list[dict]:
    """Every request at once, each on its own connection."""
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=0)
    async with httpx.AsyncClient(timeout=300, limits=limits) as client:
        start = asyncio.Event()

        async def one() -> dict:
            await start.wait()
            sent = time.monotonic()
            try:
                response = await client.post(f"{url}/v1/audio/transcriptions", files={"file": ("clip.wav", audio)})
            except httpx.TransportError as error:
                return {"status": 0, "seconds": time.monotonic() - sent, "error": repr(error)}
            body = response.json() if response.headers.get("content-type", "").startswith("application/json") else {}
            return {
                "status": response.status_code, "seconds": time.monotonic() - sent,
                "retry_after": response.headers.get("retry-after"), "text": body.get("text"),
                "error_code": (body.get("error") or {}).get("code"),
            }

        tasks = [asyncio.create_task(one()) for _ in range(num_requests)]
        await asyncio.sleep(0.2)  # every task is waiting at the gate
        start.set()
        return await asyncio.gather(*tasks)


def engine_idle(server: ServerProcess, timeout_s: float = 30.0) -> dict[str, float]:
    deadline = time.monotonic() + timeout_s
    while True:
        metrics = server.metrics()
        held = {name: metrics[name] for name in ENGINE_HELD}
        if not any(held.values()) or time.monotonic() > deadline:
            return held
        time.sleep(0.1)


def settle(server: ServerProcess) -> dict[str, float]:
    """Waits for the engine to finish, then past the idle time after which it hands its freed
    heap back to the OS; returns what the engine still held when it finished."""
    held = engine_idle(server)
    time.sleep(IDLE_RELEASE_AFTER_S + 1.0)
    return held


def run_overload(num_requests: int, max_num_seqs: int, max_waiting: int, audio: bytes, bursts: int = 2) -> dict:
    """`bursts` bursts of `num_requests`, each after the engine has been idle a moment: memory
    must not grow from one burst to the next (the first also touches the KV pool and
    workspaces for the first time), and must come back down once the engine is idle."""
    server = ServerProcess(
        ["--dtype", "float32", "--max-num-seqs", str(max_num_seqs), "--max-encoder-batch", "1",
         "--max-waiting-requests", str(max_waiting), "--preprocess-workers", "1"]
    )
    try:
        server.wait_ready()
        warm = httpx.post(f"{server.url}/v1/audio/transcriptions", files={"file": audio}, timeout=120)
        assert warm.status_code == 200, warm.text
        expected_text = warm.json()["text"]
        settle(server)
        rss_before = server.tree_rss_bytes()
        results, peaks, walls, idle = [], [], [], []
        for _ in range(bursts):
            sampler = MemorySampler(server)
            sampler.start()
            started = time.monotonic()
            results += asyncio.run(burst(server.url, audio, num_requests))
            walls.append(round(time.monotonic() - started, 2))
            peaks.append(_mb(sampler.stop()))
            held_after = settle(server)
            idle.append(_mb(server.tree_rss_bytes()))
        health = httpx.get(f"{server.url}/health", timeout=5).status_code
        after = httpx.post(f"{server.url}/v1/audio/transcriptions", files={"file": audio}, timeout=120)
        rss_after = server.tree_rss_bytes()
        server_alive = server.process.poll() is None
    finally:
        server.stop()
    statuses: dict[str, int] = {}
    for result in results:
        statuses[str(result["status"])] = statuses.get(str(result["status"]), 0) + 1
    refused = [r for r in results if r["status"] in (429, 503)]
    accepted = [r for r in results if r["status"] == 200]
    return {
        "requests": num_requests, "max_num_seqs": max_num_seqs, "max_waiting_requests": max_waiting,
        "bursts": bursts, "statuses": statuses, "wall_seconds": walls,
        "refused_with_retry_after": sum(1 for r in refused if r["retry_after"] and int(r["retry_after"]) >= 1),
        "refused_codes": sorted({r["error_code"] for r in refused}),
        "refused_latency_ms_p50": _ms(statistics.median(r["seconds"] for r in refused)) if refused else None,
        "refused_latency_ms_max": _ms(max(r["seconds"] for r in refused)) if refused else None,
        "accepted_latency_ms_max": _ms(max(r["seconds"] for r in accepted)) if accepted else None,
        "accepted_texts_as_expected": sum(1 for r in accepted if r["text"] == expected_text),
        "rss_mb_before": _mb(rss_before), "rss_mb_peak_per_burst": peaks,
        "rss_mb_idle_after_burst": idle, "rss_mb_after": _mb(rss_after),
        "engine_held_after": held_after, "health_after": health, "request_after": after.status_code,
        "text_after_as_expected": after.status_code == 200 and after.json()["text"] == expected_text,
        "server_alive": server_alive,
    }


def _ms(seconds: float) -> float:
    return round(seconds * 1000, 1)


def _mb(num_bytes: int) -> float:
    return round(num_bytes / 2**20, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--max-num-seqs", type=int, default=2)
    parser.add_argument("--max-waiting-requests", type=int, default=8)
    parser.add_argument("--bursts", type=int, default=2)
    parser.add_argument("--save-result", type=Path, default=None)
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        name = next(iter(short_clips(1, Path(tmp))))
        audio = (Path(tmp) / name).read_bytes()
    result = run_overload(args.requests, args.max_num_seqs, args.max_waiting_requests, audio, args.bursts)
    print(json.dumps(result, indent=2))
    if args.save_result:
        args.save_result.write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
