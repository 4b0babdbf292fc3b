"""The `tiergate` command line: one module per command group under gateway.commands."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys
from collections.abc import Sequence

import gateway.commands


def build_parser() -> argparse.ArgumentParser:
    """Every module in gateway.commands exposes register(subparsers)."""
    parser = argparse.ArgumentParser(prog="tiergate", description="Multi-tenant LLM gateway")
    subparsers = parser.add_subparsers(dest="command", required=True)
    for info in sorted(pkgutil.iter_modules(gateway.commands.__path__), key=lambda i: i.name):
        module = importlib.import_module(f"gateway.commands.{info.name}")
        module.register(subparsers)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    # Each subcommand sets func(args) -> exit code.
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
