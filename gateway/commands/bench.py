"""`tiergate bench offline`, `tiergate bench engine`, `tiergate bench serve` and
`tiergate bench peer`: seeded benchmarks with a printed table.

Each benchmark is a module with `add_arguments(parser)`, its description as its docstring, and
an entry point taking the parsed arguments and returning the exit code. Heavy work (torch
models, servers) starts when the command runs, not when `tiergate` starts. Benchmarks never
gate CI on wall time.
"""

from __future__ import annotations

import argparse
import functools
import sys
from collections.abc import Callable

from bench import engine as bench_engine
from bench import offline as bench_offline
from bench.serve import command as bench_serve
from bench.serve import peer as bench_peer
from bench.serve.errors import BenchServeError

_Entry = Callable[[argparse.Namespace], int]

# name, module, entry point, one-line summary
_BENCHMARKS = [
    ("offline", bench_offline, bench_offline.report,
     "engine throughput on a workload file (random weights), optionally vs HF generate"),
    ("engine", bench_engine, bench_engine.report,
     "the engine's host work per step and per request, without model work"),
    ("serve", bench_serve, bench_serve.run_command,
     "open-loop HTTP/SSE load against tiergate serve; --sweep compares configurations"),
    ("peer", bench_peer, bench_peer.run_command,
     "tiergate vs llama.cpp's llama-server (--compare-llamacpp) on the same model, prompts "
     "and client"),
]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = subparsers.add_parser("bench", help="run a benchmark and print a table")
    commands = group.add_subparsers(dest="bench_command", required=True)
    for name, module, entry, summary in _BENCHMARKS:
        parser = commands.add_parser(
            name, help=summary, description=module.__doc__,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )
        module.add_arguments(parser)
        parser.set_defaults(func=functools.partial(_run, name, entry))


def _run(name: str, entry: _Entry, args: argparse.Namespace) -> int:
    try:
        return entry(args)
    except BenchServeError as exc:
        print(f"tiergate bench {name}: {exc}", file=sys.stderr)
        return 1
