"""How many CPUs this process may use: its affinity mask and its control group's CPU quota
(`docker run --cpus`, a Kubernetes CPU limit); and its control group's memory limit.

os.cpu_count() and torch's default thread count see the host's cores. In a container limited
to 2 CPUs on a 64-core host, every torch and C-kernel team would start 64 threads, which the
quota then throttles in turn: each decode step waits for its slowest thread, descheduled for
the rest of a 100 ms quota period. OMP_NUM_THREADS, where set, is the operator's choice and
is kept."""

from __future__ import annotations

import logging
import math
import os
from pathlib import Path

logger = logging.getLogger(__name__)

CGROUP_ROOT = Path("/sys/fs/cgroup")
PROC_CGROUP = Path("/proc/self/cgroup")


def cgroup_cpu_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> float | None:
    """The tightest CPU quota on this process's control group and its parents, in CPUs, or
    None where there is none (or no cgroup file system to read)."""
    limits = [_v2_limit(directory) if v2 else _v1_limit(directory)
              for v2, directory in _groups("cpu", ("cpu", "cpu,cpuacct", "cpuacct,cpu"), root, proc_cgroup)]
    known = [limit for limit in limits if limit is not None]
    return min(known) if known else None


def cgroup_memory_limit(root: Path = CGROUP_ROOT, proc_cgroup: Path = PROC_CGROUP) -> int | None:
    """The tightest memory limit on this process's control group and its parents, in bytes, or
    None where there is none (v2's "max", v1's page-rounded 2^63)."""
    limits = []
    for v2, directory in _groups("memory", ("memory",), root, proc_cgroup):
        try:
            text = (directory / ("memory.max" if v2 else "memory.limit_in_bytes")).read_text().strip()
        except OSError:
            continue
        if text.isdigit() and int(text) < 1 << 62:
            limits.append(int(text))
    return min(limits) if limits else None


def _groups(controller: str, v1_mounts: tuple[str, ...], root: Path, proc_cgroup: Path) -> list[tuple[bool, Path]]:
    """(cgroup v2?, directory) for this process's group and its parents in the hierarchy that
    holds `controller` (v1: mounted under one of v1_mounts)."""
    try:
        lines = proc_cgroup.read_text().splitlines()
    except OSError:
        return []
    groups = []
    for line in lines:
        _, controllers, path = (line.split(":", 2) + ["", ""])[:3]
        if controllers == "":  # cgroup v2: one hierarchy
            groups += [(True, directory) for directory in _levels(root, path)]
        elif controller in controllers.split(","):  # cgroup v1: the controller's own hierarchy
            mount = next((root / name for name in v1_mounts if (root / name).is_dir()), None)
            if mount is not None:
                groups += [(False, directory) for directory in _levels(mount, path)]
    return groups


def _levels(mount: Path, path: str) -> list[Path]:
    """The group's directory and its parents up to the mount. Inside a container the path
    /proc names is often the host's (/docker/<id>), with the container's own group mounted at
    the root: those directories do not exist here and the mount itself is read."""
    parts = [part for part in path.strip().split("/") if part and part != ".."]
    directories = [mount.joinpath(*parts[:depth]) for depth in range(len(parts), -1, -1)]
    return [directory for directory in directories if directory.is_dir()]


def _v2_limit(directory: Path) -> float | None:
    try:
        quota, period = (directory / "cpu.max").read_text().split()[:2]
    except (OSError, ValueError):
        return None
    return None if quota == "max" else _ratio(quota, period)


def _v1_limit(directory: Path) -> float | None:
    try:
        quota = (directory / "cpu.cfs_quota_us").read_text().strip()
        period = (directory / "cpu.cfs_period_us").read_text().strip()
    except OSError:
        return None
    return None if quota.startswith("-") else _ratio(quota, period)


def _ratio(quota: str, period: str) -> float | None:
    try:
        quota_us, period_us = int(quota), int(period)
    except ValueError:
        return None
    return quota_us / period_us if quota_us > 0 and period_us > 0 else None


def usable_cpus() -> int:
    """The CPUs this process may run on, at most its quota rounded up (1.5 CPUs: 2 threads)."""
    try:
        count = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # (not on every platform)
        count = os.cpu_count() or 1
    limit = cgroup_cpu_limit()
    if limit is not None:
        count = min(count, max(1, math.ceil(limit - 1e-9)))
    return max(1, count)


def fit_threads_to_quota() -> None:
    """Sets torch's intra-op threads (which the C kernels use too) to the usable CPUs where it
    would start more, unless OMP_NUM_THREADS says how many."""
    if os.environ.get("OMP_NUM_THREADS"):
        return
    import torch

    usable = usable_cpus()
    if torch.get_num_threads() > usable:
        logger.info("torch threads: %d (the CPUs this process may use: affinity and cgroup quota), not %d",
                    usable, torch.get_num_threads())
        torch.set_num_threads(usable)
