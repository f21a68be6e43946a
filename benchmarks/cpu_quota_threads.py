"""Offline transcription time of 10 recordings of ../shared/audio with the engine's threads as
they are at start: run it inside a CPU quota (docker --cpus, a cgroup) with and without
OMP_NUM_THREADS to compare torch's own thread count with the quota's (asrserve/worker/cpu_quota.py).

    python benchmarks/cpu_quota_threads.py    # best of 3, after a warm-up
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from asrserve.entrypoints.offline import ASR  # noqa: E402
from benchmarks.workloads import SHARED_AUDIO  # noqa: E402


def main() -> None:
    files = sorted(SHARED_AUDIO.glob("*.wav"))[:8] + sorted(SHARED_AUDIO.glob("*.flac"))[:4]
    if not files:
        raise SystemExit("../shared/audio is needed for the recordings")
    asr = ASR()
    asr.transcribe(files[:2])  # warm-up
    best = float("inf")
    for _ in range(3):
        start = time.perf_counter()
        asr.transcribe(files)
        best = min(best, time.perf_counter() - start)
    print(f"threads {torch.get_num_threads()} files {len(files)} best {best:.2f} s")


if __name__ == "__main__":
    main()
