"""glibc's heap and the processes' resident memory: what each asrserve process keeps of the
memory it has freed. Not glibc (musl, macOS): nothing to do."""

from __future__ import annotations

import ctypes
import functools

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
