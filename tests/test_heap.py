"""The CPU KV pool's memory: zeros from the OS, resident only where it is written."""

from __future__ import annotations

import os
import sys

import pytest
import torch

from asrserve.engine.engine_core import EngineCore
from asrserve.worker.heap import release_pages, zeroed_pages
from benchmarks.idle_memory import rss_mb
from tests.conftest import engine_config


def _resident_bytes() -> int:
    return int(rss_mb(os.getpid()) * (1 << 20))


@pytest.mark.skipif(not os.path.exists("/proc/self/status"), reason="reads Linux's /proc")
def test_zeroed_pages_are_zeros_committed_only_where_written():
    before = _resident_bytes()
    pool = zeroed_pages((64, 1024, 1024), torch.float32)  # 256 MiB
    assert pool.shape == (64, 1024, 1024) and pool.dtype == torch.float32
    assert _resident_bytes() - before < 32 << 20  # (torch.zeros: all 256 MiB, written up front)
    pool[3].fill_(1.5)  # one block written: its 4 MiB committed, the rest still the OS's zeros
    assert _resident_bytes() - before < 48 << 20
    assert pool[3].eq(1.5).all() and not pool[:3].any() and not pool[4:].any()
    halves = zeroed_pages((2, 3), torch.bfloat16)
    assert halves.dtype == torch.bfloat16 and not halves.any()


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="MADV_DONTNEED zeroes pages on Linux")
def test_released_pages_read_as_zeros_and_leave_the_resident_set():
    pool = zeroed_pages((32, 1024, 1024), torch.float32)  # 128 MiB
    pool.fill_(2.0)
    written = _resident_bytes()
    release_pages(pool)
    assert written - _resident_bytes() > 96 << 20
    assert not pool.any()
    pool[1].fill_(3.0)  # still a writable pool
    assert pool[1].eq(3.0).all() and not pool[2:].any()


def test_a_kv_pool_larger_than_the_machine_will_give_is_a_clear_error():
    with pytest.raises(ValueError, match=r"the KV cache of \d+ blocks \(.* GiB\) could not be allocated on cpu"):
        EngineCore(engine_config(dtype="float32", num_kv_blocks=1 << 36))


def test_the_engine_hands_its_pool_back_once_idle_and_only_with_no_block_in_use(monkeypatch):
    """The engine loop, idle IDLE_RELEASE_AFTER_S after work, releases once (not again while it
    stays idle), and says whether any KV block is still in use; nothing before any work."""
    import threading
    import time
    from multiprocessing import Pipe
    from types import SimpleNamespace

    from asrserve.engine import engine_process

    monkeypatch.setattr(engine_process, "IDLE_RELEASE_AFTER_S", 0.05)
    releases: list[bool] = []
    steps_left = [0]
    blocks = SimpleNamespace(num_used_blocks=0)

    def step():
        steps_left[0] -= 1
        return []

    runner = SimpleNamespace(release_idle_memory=lambda kv_pool_unused: releases.append(kv_pool_unused))
    core = SimpleNamespace(has_work=lambda: steps_left[0] > 0, step=step, block_manager=blocks, abort=lambda _: None,
                           runner=runner)
    server_end, engine_end = Pipe()
    _, outbox = Pipe()
    loop = engine_process.EngineLoop(core, engine_end, outbox)
    monkeypatch.setattr(loop, "_stats", lambda: None)
    thread = threading.Thread(target=loop.run, daemon=True)
    thread.start()

    def work_then_idle(used_blocks: int) -> None:
        blocks.num_used_blocks = used_blocks
        steps_left[0] = 2
        expected = len(releases) + 1
        server_end.send(("abort", []))  # wakes the loop, which then steps
        deadline = time.monotonic() + 10
        while len(releases) < expected and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.3)  # six more idle periods: no second release

    time.sleep(0.3)
    assert releases == []  # idle from the start: nothing to hand back
    work_then_idle(used_blocks=0)
    assert releases == [True]
    work_then_idle(used_blocks=3)
    assert releases == [True, False]
    server_end.send(("shutdown", None))
    thread.join(5)
    assert not thread.is_alive()


def test_a_pool_the_os_will_not_take_back_stays_resident_and_the_engine_goes_on(monkeypatch, caplog):
    """madvise can refuse (EINVAL on locked memory): that ended the engine process's loop."""
    from types import SimpleNamespace

    from asrserve.worker import model_runner

    def refuse(pages):
        raise OSError(22, "madvise(MADV_DONTNEED) failed on the KV pool")

    monkeypatch.setattr(model_runner, "release_pages", refuse)
    monkeypatch.setattr(model_runner, "return_freed_memory", lambda: None)
    runner = SimpleNamespace(device=torch.device("cpu"), kv_cache=torch.zeros(4))
    model_runner.ModelRunner.release_idle_memory(runner, kv_pool_unused=True)
    assert "stay resident" in caplog.text


def test_the_memory_limit_is_the_container_s_or_the_machine_s_whichever_is_less(tmp_path, monkeypatch):
    from asrserve.worker import heap
    from asrserve.worker.cpu_quota import cgroup_memory_limit

    v2, proc = tmp_path / "v2", tmp_path / "proc_cgroup"
    v2.mkdir()
    proc.write_text("0::/\n")
    (v2 / "memory.max").write_text("max\n")
    assert cgroup_memory_limit(v2, proc) is None
    (v2 / "memory.max").write_text("4294967296\n")
    assert cgroup_memory_limit(v2, proc) == 4 << 30  # a 4Gi pod
    v1 = tmp_path / "v1"
    (v1 / "memory").mkdir(parents=True)
    proc.write_text("5:memory:/docker/abc\n4:cpu,cpuacct:/docker/abc\n")  # (the host's path: the mount is read)
    (v1 / "memory" / "memory.limit_in_bytes").write_text("9223372036854771712\n")  # v1's "no limit"
    assert cgroup_memory_limit(v1, proc) is None
    (v1 / "memory" / "memory.limit_in_bytes").write_text("2147483648\n")
    assert cgroup_memory_limit(v1, proc) == 2 << 30
    assert cgroup_memory_limit(tmp_path / "none", tmp_path / "none") is None

    meminfo = tmp_path / "meminfo"
    meminfo.write_text("MemFree:  100 kB\nMemTotal:       8000000 kB\n")
    monkeypatch.setattr(heap, "cgroup_memory_limit", lambda: None)
    assert heap.memory_limit_bytes(str(meminfo)) == 8000000 * 1024  # no limit: the machine's RAM
    monkeypatch.setattr(heap, "cgroup_memory_limit", lambda: 4 << 30)
    assert heap.memory_limit_bytes(str(meminfo)) == 4 << 30
    assert heap.memory_limit_bytes(str(tmp_path / "none")) == 4 << 30
    monkeypatch.setattr(heap, "cgroup_memory_limit", lambda: None)
    assert heap.memory_limit_bytes(str(tmp_path / "none")) is None


def test_a_pool_past_the_memory_there_is_is_named_at_start(monkeypatch, caplog):
    """Its pages are committed as written, so such a pool starts, then runs out under load."""
    from asrserve.worker import model_runner

    monkeypatch.setattr(model_runner, "memory_limit_bytes", lambda: 64 << 20)  # 64 MiB
    EngineCore(engine_config(dtype="float32", num_kv_blocks=4000))  # 0.73 GiB of pool (tiny.en, float32)
    assert "are more than the 0.06 GiB of memory this process may use" in caplog.text
    caplog.clear()
    monkeypatch.setattr(model_runner, "memory_limit_bytes", lambda: 8 << 30)
    EngineCore(engine_config(dtype="float32", num_kv_blocks=4000))
    assert "may use" not in caplog.text
