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
