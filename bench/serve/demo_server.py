"""A `tiergate serve --model demo` for ops/bench's scripts: the benchmark's BenchServer with
the default tier table and engine limits, started in the current directory (so that a
script run from another checkout's directory measures that checkout), on a temporary work
directory that goes with it."""

from __future__ import annotations

import contextlib
import tempfile
from collections.abc import Iterator
from pathlib import Path

from bench.serve.server import VARIANTS, BenchServer, EngineLimits
from gateway.server.settings import GatewaySettings
from policies import TierTable

__all__ = ["demo_server"]


@contextlib.contextmanager
def demo_server(variant: str) -> Iterator[BenchServer]:
    """The server of VARIANTS[variant] (`tiered`, say), ready; stopped on exit."""
    limits = EngineLimits(model_dir=None, demo_model_dir=GatewaySettings().demo_model_dir)
    with tempfile.TemporaryDirectory() as work, BenchServer(
        VARIANTS[variant], TierTable(), limits, Path(work)
    ) as server:
        yield server
