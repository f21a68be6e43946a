"""Is the server still responsive while the engine is saturated? `asrserve serve` runs as a real
subprocess; N clients each upload the same long recording at once, and a probe asks /health
every few milliseconds until they have all finished.

    python benchmarks/health_under_load.py [--concurrency 16] [--audio-seconds 108] [--save-result out.json]

The long recording joins the English recordings of ../shared/audio (real speech; espeak-ng
sentences when the folder is absent) into --audio-seconds of 16 kHz audio. Reported: /health
latency percentiles during the run, and the server's throughput (RTFx = seconds of audio /
wall-clock seconds from the first upload to the last response).
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

import httpx
import numpy as np
import soundfile

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asrserve.audio.decode import load_audio
from asrserve.config import SAMPLE_RATE
from benchmarks.workloads import english_recordings
from tests.conftest import SENTENCES, synthesize
from tests.server_utils import ServerProcess


def long_recording(seconds: float, directory: Path) -> Path:
    pieces = [audio for audio, _ in english_recordings()]
    if not pieces:
        pieces = [load_audio(synthesize(text, directory / f"s{i}.wav")) for i, text in enumerate(SENTENCES)]
    pause = np.zeros(SAMPLE_RATE // 2, np.float32)
    audio = np.zeros(0, np.float32)
    while len(audio) < seconds * SAMPLE_RATE:
        for piece in pieces:
            audio = np.concatenate([audio, piece, pause])
    path = directory / "long.wav"
    soundfile.write(path, audio[: int(seconds * SAMPLE_RATE)], SAMPLE_RATE)
    return path


async def run_load(url: str, audio: bytes, concurrency: int, probe_interval: float) -> dict:
    latencies: list[float] = []
    async with httpx.AsyncClient(timeout=3600) as http, httpx.AsyncClient(timeout=10) as probe:

        async def transcribe() -> tuple[int, str]:
            response = await http.post(f"{url}/v1/audio/transcriptions", files={"file": ("long.wav", audio)})
            return response.status_code, response.json().get("text", "")

        started = time.perf_counter()
        tasks = [asyncio.create_task(transcribe()) for _ in range(concurrency)]
        while not all(task.done() for task in tasks):
            begin = time.perf_counter()
            response = await probe.get(f"{url}/health")
            latencies.append(time.perf_counter() - begin)
            assert response.status_code == 200, response.text
            await asyncio.sleep(probe_interval)
        results = [task.result() for task in tasks]
        wall = time.perf_counter() - started
    ms = np.array(latencies) * 1000
    return {
        "health_probes": len(latencies),
        "health_p50_ms": round(float(np.percentile(ms, 50)), 2),
        "health_p99_ms": round(float(np.percentile(ms, 99)), 2),
        "health_max_ms": round(float(ms.max()), 2),
        "wall_seconds": round(wall, 1),
        "statuses": sorted({status for status, _ in results}),
        "identical_texts": len({text for _, text in results}) == 1,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=None, help="model to serve (default: the bundled tiny.en)")
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--audio-seconds", type=float, default=108.0)
    parser.add_argument("--probe-interval", type=float, default=0.02, help="seconds between /health probes")
    parser.add_argument("--save-result", default=None)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as directory:
        path = long_recording(args.audio_seconds, Path(directory))
        server = ServerProcess([args.model] if args.model else [])
        try:
            server.wait_ready()
            result = asyncio.run(run_load(server.url, path.read_bytes(), args.concurrency, args.probe_interval))
            metrics = server.metrics()
        finally:
            server.stop()
    audio_seconds = args.concurrency * args.audio_seconds
    result |= {
        "model": args.model or "tiny.en (bundled)",
        "concurrency": args.concurrency,
        "audio_seconds_per_request": args.audio_seconds,
        "rtfx": round(audio_seconds / result["wall_seconds"], 2),
        "encoder_forwards": int(metrics["asrserve_encoder_batch_size_count"]),
        "mean_encoder_batch": round(
            metrics["asrserve_encoder_batch_size_sum"] / max(metrics["asrserve_encoder_batch_size_count"], 1), 2
        ),
        "kv_cache_blocks_used_after": metrics["asrserve_kv_cache_blocks_used"],
        "encoder_cache_entries_after": metrics["asrserve_encoder_cache_entries"],
        "machine": f"{platform.machine()}, {__import__('os').cpu_count()} CPUs",
    }
    print(json.dumps(result, indent=2))
    if args.save_result:
        Path(args.save_result).write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
