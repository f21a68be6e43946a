"""The answers of start-up kernel checks, kept on disk for the next process on this machine.

packed_linear checks, once per weight shape, that oneDNN's kernel gives each row the same bits
whatever the batch (a property of the kernel this CPU and torch build get, not a promise).
The checks read random weights as large as the model's (52k x 384 for the output projection)
and took ~1.1 s of every start of tiny.en on 2 cores: every server, every CLI run, every
engine process a test starts. Their answers are deterministic for a given CPU, torch build,
thread count and check code, so each is kept under that key in cpu_kernels.cache_dir() and
read back, and a change to any of those makes a new key (the check runs again).
ASRSERVE_KERNEL_CHECK_CACHE=0 turns the keeping off.
"""

from __future__ import annotations

import functools
import hashlib
import os
import platform
import tempfile
from pathlib import Path

import torch

from asrserve.model import cpu_kernels


@functools.cache
def _machine() -> bytes:
    """What decides which kernel oneDNN picks here: the CPU (model and instruction sets) and
    the torch build (its version, oneDNN's version and build settings)."""
    try:
        cpuinfo = Path("/proc/cpuinfo").read_text()
        cpu = "\n".join(sorted({line for line in cpuinfo.splitlines()
                                if line.startswith(("model name", "flags", "vendor_id", "cpu family", "model\t"))}))
    except OSError:
        cpu = platform.processor()
    return "\n".join((cpu, platform.machine(), torch.__version__, torch.__config__.show())).encode()


def _path(name: str, code: bytes, arguments: tuple) -> Path | None:
    if os.environ.get("ASRSERVE_KERNEL_CHECK_CACHE", "1") == "0":
        return None
    parts = (_machine(), code, repr((arguments, torch.get_num_threads())).encode())
    key = hashlib.sha256(b"\0".join(parts)).hexdigest()[:24]
    return cpu_kernels.cache_dir() / f"check-{name}-{key}"


def remembered(name: str, code: bytes, arguments: tuple) -> bool | None:
    """The answer kept for check `name` (whose source is `code`) with these arguments, or None."""
    path = _path(name, code, arguments)
    try:
        answer = path.read_text() if path is not None else None
    except OSError:
        return None
    return {"1": True, "0": False}.get(answer)


def remember(name: str, code: bytes, arguments: tuple, answer: bool) -> None:
    """Keeps `answer`, written under a temporary name and renamed: a process starting beside
    this one reads the whole answer or none."""
    path = _path(name, code, arguments)
    if path is None:
        return
    partial = None
    try:
        handle, partial = tempfile.mkstemp(dir=path.parent, prefix=path.name, suffix=".partial")
        with os.fdopen(handle, "w") as file:
            file.write("1" if answer else "0")
        os.replace(partial, path)
    except OSError:  # a read-only cache: the check runs again next time
        pass
    finally:
        if partial is not None and os.path.exists(partial):
            os.unlink(partial)
