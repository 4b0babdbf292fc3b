"""The engine's compiled core: the modules a compiled build runs as C extensions (mypyc), and
whether this process runs them so.

Every running request passes through these modules several times a step (scheduling, the
runner's view, metering, outputs), and in Python that host work grows with the batch while
the device waits. Built with `TIERGATE_MYPYC=1` (setup.py, `make compiled`), the same source
runs as C extensions: on a 2-core AMD EPYC host, about 0.6x the host work per running request
of the pure-Python build (medians of 12 pairs: 0.61 at 128 decodes, 0.57 at 256;
ops/bench/README.md). The source is the same either way; a default install is pure Python.

What compiled modules may not do, and so the source here does not: replace a method on an
instance (a compiled class has no per-instance methods; tests wrap an engine instead), add
attributes a class does not declare, or build an Enum member with an `__init__`.

This module imports nothing of the project: setup.py reads MODULES without importing the
engine.
"""

from __future__ import annotations

import importlib
import sys

__all__ = ["MODULES", "compiled_modules", "core_name", "is_compiled"]

# Paths from the repository root.
MODULES = (
    "engine/block_hash.py",
    "engine/block_pool.py",
    "engine/fcfs_policy.py",
    "engine/kv_manager.py",
    "engine/llm_engine.py",
    "engine/metering.py",
    "engine/outputs.py",
    "engine/request.py",
    "engine/runner_view.py",
    "engine/scheduler.py",
    "engine/scheduler_output.py",
    "engine/step_plan.py",
    "engine/stop_check.py",
)


def _module_name(path: str) -> str:
    return path.removesuffix(".py").replace("/", ".")


def compiled_modules() -> list[str]:
    """The modules of MODULES this process has imported as C extensions."""
    found = []
    for path in MODULES:
        module = sys.modules.get(_module_name(path))
        file = getattr(module, "__file__", None) or ""
        if file.endswith((".so", ".pyd")):
            found.append(_module_name(path))
    return found


def is_compiled() -> bool:
    """Whether the engine's core runs compiled: every module of MODULES imported, as a C
    extension (a mix means a broken build, and reads False)."""
    for path in MODULES:
        importlib.import_module(_module_name(path))
    return len(compiled_modules()) == len(MODULES)


def core_name() -> str:
    """How logs and benchmark tables name the core this process runs."""
    return "compiled (mypyc)" if is_compiled() else "pure Python"
