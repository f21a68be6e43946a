"""The CPUs a container may use (asrserve/worker/cpu_quota.py): its cgroup's CPU quota, read the way
docker --cpus and a Kubernetes CPU limit set it, sizes torch's threads."""

from __future__ import annotations

from pathlib import Path

import torch

from asrserve.worker import cpu_quota


def _write(path: Path, text: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_cgroup_v2_quota_is_the_tightest_of_the_group_and_its_parents(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "proc_cgroup"
    _write(proc, "0::/kubepods/pod1/container\n")
    _write(root / "cpu.max", "max 100000\n")
    _write(root / "kubepods/pod1/cpu.max", "150000 100000\n")  # the pod's limit: 1.5 CPUs
    _write(root / "kubepods/pod1/container/cpu.max", "max 100000\n")
    assert cpu_quota.cgroup_cpu_limit(root, proc) == 1.5
    _write(root / "kubepods/pod1/cpu.max", "max 100000\n")
    assert cpu_quota.cgroup_cpu_limit(root, proc) is None


def test_cgroup_v2_in_a_container_reads_its_own_group_at_the_mount(tmp_path):
    """docker --cpus 2 with a private cgroup namespace: /proc names "/", the mount is the group."""
    root, proc = tmp_path / "cgroup", tmp_path / "proc_cgroup"
    _write(proc, "0::/\n")
    _write(root / "cpu.max", "200000 100000\n")
    assert cpu_quota.cgroup_cpu_limit(root, proc) == 2.0


def test_cgroup_v1_quota_and_a_host_path_that_does_not_exist_inside(tmp_path):
    root, proc = tmp_path / "cgroup", tmp_path / "proc_cgroup"
    _write(proc, "4:memory:/docker/abc\n3:cpu,cpuacct:/docker/abc\n")
    _write(root / "cpu,cpuacct/cpu.cfs_quota_us", "300000\n")
    _write(root / "cpu,cpuacct/cpu.cfs_period_us", "100000\n")
    assert cpu_quota.cgroup_cpu_limit(root, proc) == 3.0
    _write(root / "cpu,cpuacct/cpu.cfs_quota_us", "-1\n")  # no limit
    assert cpu_quota.cgroup_cpu_limit(root, proc) is None


def test_no_cgroup_file_system_means_no_limit(tmp_path):
    assert cpu_quota.cgroup_cpu_limit(tmp_path / "none", tmp_path / "no_proc_file") is None
    _write(tmp_path / "proc_cgroup", "0::/\n")
    _write(tmp_path / "cgroup/cpu.max", "garbage\n")
    assert cpu_quota.cgroup_cpu_limit(tmp_path / "cgroup", tmp_path / "proc_cgroup") is None


def test_threads_fit_the_quota_unless_omp_num_threads_chose(monkeypatch):
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(8)
        monkeypatch.setattr(cpu_quota, "cgroup_cpu_limit", lambda: 1.5)
        monkeypatch.setattr(cpu_quota.os, "sched_getaffinity", lambda pid: set(range(64)))
        assert cpu_quota.usable_cpus() == 2
        monkeypatch.setenv("OMP_NUM_THREADS", "8")
        cpu_quota.fit_threads_to_quota()
        assert torch.get_num_threads() == 8  # the operator's choice stands
        monkeypatch.delenv("OMP_NUM_THREADS")
        cpu_quota.fit_threads_to_quota()
        assert torch.get_num_threads() == 2
        monkeypatch.setattr(cpu_quota, "cgroup_cpu_limit", lambda: None)
        torch.set_num_threads(8)
        cpu_quota.fit_threads_to_quota()
        assert torch.get_num_threads() == 8  # 64 CPUs usable: torch's own count stands
    finally:
        torch.set_num_threads(threads)


def test_the_engine_sizes_its_threads_by_the_quota(monkeypatch):
    from asrserve.engine.engine_core import EngineCore
    from tests.conftest import engine_config

    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(4)
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        monkeypatch.setattr(cpu_quota, "cgroup_cpu_limit", lambda: 1.0)
        EngineCore(engine_config(dtype="float32"))
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(threads)
