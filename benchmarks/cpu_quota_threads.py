"""Offline transcription time of 10 recordings of ../shared/audio with the engine's threads as
they are at start: run it inside a CPU quota (docker --cpus, a cgroup) with and without
OMP_NUM_THREADS to compare torch's own thread count with the quota's (asrserve/worker/cpu_quota.py).

    python benchmarks/cpu_quota_threads.py    # best of 3, after a warm-up
"""

import time, glob, torch
from asrserve.entrypoints.offline import ASR
files = sorted(glob.glob("/work/shared/audio/*.wav"))[:8] + sorted(glob.glob("/work/shared/audio/*.flac"))[:4]
asr = ASR()
asr.transcribe(files[:2])
best = 1e9
for _ in range(3):
    t = time.perf_counter(); asr.transcribe(files); best = min(best, time.perf_counter() - t)
print(f"threads {torch.get_num_threads()} files {len(files)} best {best:.2f} s")
