"""`tiergate bench offline` (and later `bench serve`): seeded benchmarks with a printed table.

Each benchmark is a sub-subcommand registered by its own small function, so a new one (e.g.
`serve`) is one more `_register_*` call. Benchmarks never gate CI on wall time.
"""

from __future__ import annotations

import argparse

from engine import bench_offline


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = subparsers.add_parser("bench", help="run a benchmark and print a table")
    commands = group.add_subparsers(dest="bench_command", required=True)
    _register_offline(commands)


def _register_offline(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    offline = commands.add_parser(
        "offline",
        help="engine throughput on a workload file (random weights), optionally vs HF generate",
        description=bench_offline.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    bench_offline.add_arguments(offline)
    offline.set_defaults(func=_offline)


def _offline(args: argparse.Namespace) -> int:
    return bench_offline.report(args)
