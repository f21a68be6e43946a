"""glibc's heap and the processes' resident memory: what each asrserve process keeps of the
memory it has freed. Not glibc (musl, macOS): nothing to do."""

from __future__ import annotations

import ctypes
import functools
import math
import mmap
import re
import sys
from pathlib import Path
from typing import TYPE_CHECKING

from asrserve.worker.cpu_quota import cgroup_memory_limit

if TYPE_CHECKING:  # (torch only where the KV pool lives: the API process imports this module too)
    import torch

M_TOP_PAD = -2  # mallopt's parameter: how much freed memory above the heap's top stays mapped


@functools.cache
def _libc() -> ctypes.CDLL | None:
    try:
        libc = ctypes.CDLL("libc.so.6")
        libc.malloc_trim  # noqa: B018 (glibc's, not every libc's)
    except (OSError, AttributeError):
        return None
    return libc


def keep_freed_memory_mapped() -> None:
    """Asks glibc to keep 1 GiB of freed heap mapped instead of returning it to the OS. Each
    encoder forward allocates and frees hundreds of MB of activations; without this they come
    back as fresh pages every step, and faulting them in costs ~15% of a CPU encoder forward
    (measured on tiny.en, batch 8)."""
    libc = _libc()
    if libc is not None:
        libc.mallopt(M_TOP_PAD, 1 << 30)


def return_freed_memory() -> None:
    """Gives the heap's free pages back to the OS (glibc's malloc_trim, which also releases
    free pages below the top, in every arena). Otherwise resident memory ratchets up to the
    highest the heap ever reached: in the engine with the 1 GiB kept mapped above (tiny.en:
    +60-95 MB in one burst out of several, depending on how its allocations interleaved); in
    the API process, in the arenas of the threads that read audio, answer and stream. Each
    process calls it once it has been idle for a second, so back-to-back work does not fault
    the pages in again."""
    libc = _libc()
    if libc is not None:
        libc.malloc_trim(0)


def zeroed_pages(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled CPU tensor over a private anonymous mapping: the OS's zero pages, each
    committed when it is first written. torch.zeros wrote every page up front: the CPU KV pool
    (1.5 GB for tiny.en in float32) cost 0.6 s of each engine's start and was resident from
    the first second, though a few requests touch a few of its blocks. Still zeros, not
    garbage: padded block-table entries read masked but real memory. A mapping larger than the
    OS will ever give (its overcommit heuristic) fails here with OSError, as malloc would."""
    import torch

    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:  # (a pool of no blocks: whoever asked for it says why that cannot serve)
        return torch.zeros(shape, dtype=dtype)
    mapping = mmap.mmap(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    # (frombuffer keeps `mapping` alive as long as any view of the tensor is)
    return torch.frombuffer(mapping, dtype=torch.uint8, count=nbytes).view(dtype).view(shape)


@functools.cache
def _madvise() -> ctypes._CFuncPtr | None:
    if not sys.platform.startswith("linux"):  # (elsewhere MADV_DONTNEED need not zero the pages)
        return None
    try:
        function = ctypes.CDLL(None, use_errno=True).madvise
    except (OSError, AttributeError):
        return None
    function.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]
    return function


def release_pages(pages: torch.Tensor) -> None:
    """Hands a zeroed_pages tensor's memory back to the OS: on Linux (MADV_DONTNEED on a private
    anonymous mapping) it reads as zeros again and is resident nowhere until written; elsewhere
    nothing changes. Only for a tensor that is a whole zeroed_pages mapping, whose contents are
    no longer needed."""
    madvise = _madvise()
    if madvise is not None:
        nbytes = pages.numel() * pages.element_size()
        if madvise(pages.data_ptr(), nbytes, mmap.MADV_DONTNEED) != 0:
            raise OSError(ctypes.get_errno(), "madvise(MADV_DONTNEED) failed on the KV pool")


def memory_limit_bytes(meminfo: str = "/proc/meminfo") -> int | None:
    """The most memory this process may use: its control group's limit (a container's) or the
    machine's RAM, whichever is less; None where neither can be read."""
    limits = [limit] if (limit := cgroup_memory_limit()) is not None else []
    try:
        found = re.search(r"^MemTotal:\s+(\d+) kB", Path(meminfo).read_text(), re.MULTILINE)
    except OSError:
        found = None
    if found:
        limits.append(int(found[1]) * 1024)
    return min(limits) if limits else None
