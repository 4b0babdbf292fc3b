"""Builds and loads the engine's C++ CPU kernels: compiled at first use, cached, called by ctypes.

A kernel source is a plain C++ file with `extern "C"` functions and no torch headers (it may
include this directory's shared headers, such as vec8.h), so a build takes about a second. The
shared library is cached under the user's cache directory (`$XDG_CACHE_HOME/tiergate/kernels`),
keyed by the source, the shared headers, the flags, the compiler and the CPU (-march=native),
and built into a temporary file that is renamed into place, so concurrent processes agree. A
missing compiler or a failed build yields None: callers keep their torch path.
"""

from __future__ import annotations

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from pathlib import Path

__all__ = ["FLAGS", "load_library"]

logger = logging.getLogger(__name__)

# -fopenmp: a library's NEEDED libgomp.so.1 resolves to the copy torch has already loaded, so
# kernels share torch's thread pool and torch.set_num_threads. -ffp-contract=fast lets vector
# multiply-adds become FMAs (ISO C++ mode turns contraction off).
FLAGS = ("-O3", "-march=native", "-ffp-contract=fast", "-std=c++17", "-fopenmp", "-shared",
         "-fPIC")
_BUILD_TIMEOUT_S = 300
# Headers every kernel may include (`#include "vec8.h"`): this directory is on the include path.
_INCLUDE_DIR = Path(__file__).parent


def _cpu_signature() -> str:
    """What -march=native compiles for: the CPU's model and feature flags."""
    try:
        info = Path("/proc/cpuinfo").read_text()
    except OSError:
        return platform.processor() or platform.machine()
    lines = [line for line in info.splitlines() if line.startswith(("model name", "flags"))]
    return "\n".join(sorted(set(lines)))


def _cache_dir() -> Path:
    root = os.environ.get("XDG_CACHE_HOME") or str(Path.home() / ".cache")
    return Path(root) / "tiergate" / "kernels"


def _build(compiler: str, source: str, target: Path) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=target.parent) as scratch:
        src = Path(scratch) / "kernel.cpp"
        src.write_text(source)
        built = Path(scratch) / target.name
        subprocess.run(
            [compiler, *FLAGS, f"-I{_INCLUDE_DIR}", str(src), "-o", str(built)],
            check=True, capture_output=True, text=True, timeout=_BUILD_TIMEOUT_S,
        )
        os.replace(built, target)


@functools.cache
def load_library(source_path: Path) -> ctypes.CDLL | None:
    """The library built from source_path (built on first use, then cached), or None."""
    compiler = shutil.which(os.environ.get("CXX", "g++"))
    if compiler is None or not source_path.exists():
        logger.info("no C++ compiler or no %s; using the torch path", source_path.name)
        return None
    source = source_path.read_text()
    headers = [h.read_text() for h in sorted(_INCLUDE_DIR.glob("*.h"))]
    key = hashlib.sha256(
        "\n".join([source, *headers, " ".join(FLAGS), compiler, _cpu_signature()]).encode()
    ).hexdigest()[:20]
    target = _cache_dir() / f"{source_path.stem}_{key}.so"
    try:
        if not target.exists():
            _build(compiler, source, target)
        return ctypes.CDLL(str(target))
    except (OSError, subprocess.SubprocessError) as exc:
        detail = getattr(exc, "stderr", "") or exc
        logger.warning("cannot build %s (%s); using the torch path", source_path.name, detail)
        return None
