"""Small C kernels for the CPU decode step (csrc/), built at first use and loaded with ctypes.

Each is a plain C function over raw pointers, written with AVX512-BF16 intrinsics for the
machines where asrserve runs bf16 on CPU. It is compiled (in under a second) with the
machine's C compiler, the one torch.compile needs too, into a cache directory (cache_dir()),
and its OpenMP loops run on the OpenMP runtime torch has already loaded, with torch's thread
count (passed in each call: OpenMP's own setting is per calling thread). Without AVX512-BF16, without a compiler, or if a build fails, `load` returns None and
the caller keeps its torch path (a warning says why). ASRSERVE_CPU_KERNELS=0 turns them off.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import shutil
import stat
import subprocess
import tempfile
from pathlib import Path

import torch

logger = logging.getLogger(__name__)

SOURCES = Path(__file__).parent / "csrc"
FLAGS = ("-O3", "-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512bf16", "-mfma", "-fopenmp", "-shared", "-fPIC")


@functools.cache
def cache_dir() -> Path:
    """$XDG_CACHE_HOME/asrserve/kernels (~/.cache by default), or where that cannot be written
    (a service account without a home) $TMPDIR/asrserve-kernels-<uid>, or a fresh directory of
    this process's own: a build takes under a second, so keeping it is a convenience only. A
    library found there is loaded, so only a directory this user owns and no one else may write
    to will do: in a shared /tmp another user could have made that name first, and planted one."""
    base = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "asrserve" / "kernels"
    for directory in (base, Path(tempfile.gettempdir()) / f"asrserve-kernels-{os.getuid()}"):
        try:
            directory.mkdir(mode=0o700, parents=True, exist_ok=True)
            if _is_private(directory) and os.access(directory, os.W_OK):
                return directory
        except OSError:
            pass
    return Path(tempfile.mkdtemp(prefix="asrserve-kernels-"))


def _is_private(directory: Path) -> bool:
    info = directory.lstat()  # not a symlink's target
    return stat.S_ISDIR(info.st_mode) and info.st_uid == os.getuid() and not info.st_mode & (stat.S_IWGRP | stat.S_IWOTH)


def _compiler() -> str | None:
    for name in (os.environ.get("CC"), "cc", "gcc", "clang"):
        if name and (path := shutil.which(name)):
            return path
    return None


def enabled() -> bool:
    return os.environ.get("ASRSERVE_CPU_KERNELS", "1") != "0" and torch.cpu._is_avx512_bf16_supported()


@functools.cache
def load(source_name: str, symbol: str, argtypes: tuple, extra_flags: tuple[str, ...] = ()) -> ctypes._CFuncPtr | None:
    """The C function `symbol` of csrc/<source_name>, returning int (0 on success), or None where
    it cannot run here. extra_flags: what this source needs beyond FLAGS (an instruction set)."""
    if not enabled():
        return None
    compiler = _compiler()
    if compiler is None:
        logger.warning("no C compiler found: %s runs on its slower torch path", symbol)
        return None
    source = SOURCES / source_name
    inputs = source.read_bytes() + b"".join(header.read_bytes() for header in sorted(SOURCES.glob("*.h")))
    flags = (*FLAGS, *extra_flags)
    key = hashlib.sha256(inputs + " ".join((compiler, *flags)).encode()).hexdigest()[:16]
    library = cache_dir() / f"{source.stem}-{key}.so"
    try:
        if not library.exists():  # (cache_dir made its directory)
            # Built under a temporary name and renamed: processes starting together never load
            # a half-written library.
            handle, partial = tempfile.mkstemp(dir=library.parent, suffix=".so.partial")
            os.close(handle)
            try:
                subprocess.run([compiler, *flags, f"-I{SOURCES}", "-o", partial, str(source)], check=True, capture_output=True,
                               timeout=120)
                os.replace(partial, library)
                logger.info("built the C kernel %s into %s", source.name, library)
            finally:
                if os.path.exists(partial):
                    os.unlink(partial)
        function = getattr(ctypes.CDLL(str(library)), symbol)
    except (OSError, AttributeError, subprocess.SubprocessError) as error:
        detail = getattr(error, "stderr", b"") or b""
        logger.warning("building the C kernel %s failed, using the torch path: %s %s", symbol, error,
                       detail.decode(errors="replace")[-500:])
        return None
    function.restype = ctypes.c_int
    function.argtypes = list(argtypes)
    return function
