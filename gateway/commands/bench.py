"""`tiergate bench offline`, `tiergate bench engine`, `tiergate bench serve` and
`tiergate bench peer`: seeded benchmarks with a printed table.

Each benchmark is a sub-subcommand registered by its own small function. Heavy modules (torch,
the serving benchmark) are imported when the command runs, not when `tiergate` starts.
Benchmarks never gate CI on wall time.
"""

from __future__ import annotations

import argparse
import sys
import types

from engine import bench_engine, bench_offline


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = subparsers.add_parser("bench", help="run a benchmark and print a table")
    commands = group.add_subparsers(dest="bench_command", required=True)
    _register_offline(commands)
    _register_engine(commands)
    _register_serve(commands)
    _register_peer(commands)


def _register_offline(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    _register_module(
        commands, "offline", bench_offline,
        "engine throughput on a workload file (random weights), optionally vs HF generate",
    )


def _register_engine(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    _register_module(
        commands, "engine", bench_engine,
        "the engine's host work per step and per request, without model work",
    )


def _register_module(
    commands: argparse._SubParsersAction[argparse.ArgumentParser], name: str,
    module: types.ModuleType, summary: str,
) -> None:
    """A benchmark module with add_arguments(parser) and report(args) -> exit code."""
    parser = commands.add_parser(
        name, help=summary, description=module.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    module.add_arguments(parser)
    parser.set_defaults(func=module.report)


def _register_serve(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from gateway.bench_serve import command

    serve = commands.add_parser(
        "serve",
        help="open-loop HTTP/SSE load against tiergate serve; --sweep compares configurations",
        description=command.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    command.add_arguments(serve)
    serve.set_defaults(func=_serve)


def _serve(args: argparse.Namespace) -> int:
    from gateway.bench_serve import command
    from gateway.bench_serve.errors import BenchServeError

    try:
        return command.run_command(args)
    except BenchServeError as exc:
        print(f"tiergate bench serve: {exc}", file=sys.stderr)
        return 1


def _register_peer(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from gateway.bench_serve import peer

    parser = commands.add_parser(
        "peer",
        help="tiergate vs llama.cpp's llama-server (--compare-llamacpp) on the same model, "
        "prompts and client",
        description=peer.__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    peer.add_arguments(parser)
    parser.set_defaults(func=_peer)


def _peer(args: argparse.Namespace) -> int:
    from gateway.bench_serve import peer
    from gateway.bench_serve.errors import BenchServeError

    try:
        return peer.run_command(args)
    except BenchServeError as exc:
        print(f"tiergate bench peer: {exc}", file=sys.stderr)
        return 1
