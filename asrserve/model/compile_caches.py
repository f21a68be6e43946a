"""torch.compile's and Triton's cache directories, usable before torch._dynamo is imported.

The images point TORCHINDUCTOR_CACHE_DIR (and TRITON_CACHE_DIR) into /models, so that compiled
kernels outlive a container. Importing torch._dynamo creates that directory and raises where it
cannot: a models volume mounted read-only, owned by root or by another uid (OpenShift's), or on
NFS, stopped even the bundled tiny.en, which compiles nothing, from loading."""

from __future__ import annotations

import logging
import os
import tempfile
from pathlib import Path

logger = logging.getLogger(__name__)

CACHE_VARIABLES = {"TORCHINDUCTOR_CACHE_DIR": "torchinductor", "TRITON_CACHE_DIR": "triton"}


def ensure_writable_compile_caches() -> None:
    """A cache directory set in the environment that cannot be created or written is replaced
    by one under the temporary directory (a warning says so): compiled kernels are then not
    kept between runs, and nothing else changes."""
    for variable, name in CACHE_VARIABLES.items():
        directory = os.environ.get(variable)
        if not directory or _writable(Path(directory)):
            continue
        fallback = Path(tempfile.gettempdir()) / f"asrserve-{name}-{os.getuid()}"
        os.environ[variable] = str(fallback)
        logger.warning("%s=%s cannot be written: compile caches go to %s instead (not kept across restarts)",
                       variable, directory, fallback)


def _writable(directory: Path) -> bool:
    try:
        directory.mkdir(parents=True, exist_ok=True)
    except OSError:
        return False
    return os.access(directory, os.W_OK | os.X_OK)
