"""`tiergate bench offline`, `tiergate bench engine`, `tiergate bench admission`,
`tiergate bench serve` and `tiergate bench peer`: seeded benchmarks with a printed table.

Each benchmark is a module of the top-level `bench` package (the `bench` extra brings what
they import: aiohttp, matplotlib) with `add_arguments(parser)`, its description as its
docstring, and an entry point taking the parsed arguments and returning the exit code. A
benchmark's module is imported, and its options added, only when its subcommand is chosen:
`tiergate serve` and the rest never import the bench package. Benchmarks never gate CI on
wall time.
"""

from __future__ import annotations

import argparse
import functools
import importlib
import importlib.util
import sys
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

__all__ = ["INSTALL_HINT", "register"]

INSTALL_HINT = "pip install 'tiergate[bench]'"

_Entry = Callable[[argparse.Namespace], int]


@dataclass(frozen=True)
class _Benchmark:
    name: str  # the subcommand
    module: str  # imported when the subcommand is chosen
    entry: str  # the module's function (args) -> exit code
    summary: str  # one line for `tiergate bench --help`
    needs: tuple[str, ...]  # modules of the bench extra it imports


_BENCHMARKS = (
    _Benchmark("offline", "bench.offline", "report",
               "engine throughput on a workload file (random weights), optionally vs HF generate",
               ()),
    _Benchmark("engine", "bench.engine", "report",
               "the engine's host work per step and per request, without model work", ()),
    _Benchmark("admission", "bench.admission", "report",
               "how long admission's decisions take (budgets, shedding, rate limits, admit())",
               ()),
    _Benchmark("serve", "bench.serve.command", "run_command",
               "open-loop HTTP/SSE load against tiergate serve; --sweep compares configurations",
               ("aiohttp", "matplotlib")),
    _Benchmark("peer", "bench.serve.peer", "run_command",
               "tiergate vs llama.cpp's llama-server (--compare-llamacpp) on the same model, "
               "prompts and client", ("aiohttp",)),
)
_BY_NAME = {benchmark.name: benchmark for benchmark in _BENCHMARKS}

if TYPE_CHECKING:
    _SubParsersAction = argparse._SubParsersAction[argparse.ArgumentParser]
else:  # not subscriptable at run time
    _SubParsersAction = argparse._SubParsersAction


class _LazySubParsersAction(_SubParsersAction):
    """Subcommands whose options are added when one is chosen: its module is imported then."""

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: str | Sequence[Any] | None,
        option_string: str | None = None,
    ) -> None:
        assert isinstance(values, list) and values  # a subparsers action gets [name, *args]
        benchmark = _BY_NAME.get(values[0])
        if benchmark is not None:
            _load(benchmark, self._name_parser_map[benchmark.name])
        super().__call__(parser, namespace, values, option_string)


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = subparsers.add_parser("bench", help="run a benchmark and print a table")
    commands = group.add_subparsers(
        dest="bench_command", required=True, action=_LazySubParsersAction
    )
    for benchmark in _BENCHMARKS:
        commands.add_parser(
            benchmark.name, help=benchmark.summary,
            formatter_class=argparse.RawDescriptionHelpFormatter,
        )


def _load(benchmark: _Benchmark, parser: argparse.ArgumentParser) -> None:
    """Import the benchmark and give its parser the description, options and entry point."""
    if parser.get_default("func") is not None:
        return  # loaded by an earlier parse
    missing = [name for name in benchmark.needs if importlib.util.find_spec(name) is None]
    if missing:
        sys.exit(f"tiergate bench {benchmark.name}: {', '.join(missing)} not installed; "
                 f"the benchmarks need the bench extra: {INSTALL_HINT}")
    module = importlib.import_module(benchmark.module)
    parser.description = module.__doc__
    module.add_arguments(parser)
    entry: _Entry = getattr(module, benchmark.entry)
    parser.set_defaults(func=functools.partial(_run, benchmark.name, entry))


def _run(name: str, entry: _Entry, args: argparse.Namespace) -> int:
    from bench.serve.errors import BenchServeError

    try:
        return entry(args)
    except BenchServeError as exc:
        print(f"tiergate bench {name}: {exc}", file=sys.stderr)
        return 1
