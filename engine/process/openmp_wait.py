"""How the engine process's OpenMP workers wait between parallel regions.

On the CPU every torch operator of a forward is one OpenMP parallel region: a small model's
decode step runs about a hundred matrix products, each waking the worker threads and parking
them again. libgomp (torch's OpenMP) parks a worker by spinning ``GOMP_SPINCOUNT`` times and
then sleeping on a futex; with ``OMP_WAIT_POLICY=PASSIVE`` it sleeps at once, and each region
pays a futex wake-up. libgomp's default (300,000 spins) keeps a worker spinning through whole
pauses between steps, taking a core from the gateway's process on a small machine.

The engine's process therefore gets a bounded spin, ``ENGINE_SPIN_COUNT``: long enough to
bridge the gaps between the regions of one forward, short enough that a worker is parked soon
after a step ends. Measured (ops/bench/journal.md, "The engine in rooms"): 1,000 spins run a
forward as fast as 10,000 do, and leave the gateway's process more of the CPU when small
requests come fast. A deployment that sets ``OMP_WAIT_POLICY`` or ``GOMP_SPINCOUNT`` itself
keeps its own setting.

libgomp reads these variables once, when torch loads it, so they must be in the engine
process's environment when it starts (`spawn_environment`), not set from inside it.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Iterator, Mapping

__all__ = ["ENGINE_SPIN_COUNT", "WAIT_VARIABLES", "engine_openmp_environment", "spawn_environment"]

# Spins before an idle worker sleeps.
ENGINE_SPIN_COUNT = 1_000
# The environment variables that say how libgomp's idle workers wait.
WAIT_VARIABLES = ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")


def engine_openmp_environment(environ: Mapping[str, str]) -> dict[str, str]:
    """The variables to add to environ for the engine's process: the bounded spin, unless
    environ already says how OpenMP workers wait."""
    if any(name in environ for name in WAIT_VARIABLES):
        return {}
    return {"GOMP_SPINCOUNT": str(ENGINE_SPIN_COUNT)}


@contextlib.contextmanager
def spawn_environment(extra: Mapping[str, str]) -> Iterator[None]:
    """os.environ with extra added while a child process is started (multiprocessing's spawn
    passes this process's environment on and takes no other), as it was afterwards. This
    process's own OpenMP read its variables when it loaded and is not affected."""
    previous = {name: os.environ.get(name) for name in extra}
    os.environ.update(extra)
    try:
        yield
    finally:
        for name, value in previous.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
