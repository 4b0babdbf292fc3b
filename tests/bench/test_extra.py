"""The `bench` extra: `pip install tiergate` brings neither aiohttp nor matplotlib, serving
never imports them (nor the bench package), and `tiergate bench` without them says what to
install."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import tomllib
from pathlib import Path

from gateway.commands.bench import INSTALL_HINT

REPO = Path(__file__).resolve().parents[2]
BENCH_ONLY = {"aiohttp", "matplotlib"}


def _names(requirements: list[str]) -> set[str]:
    match = (re.match(r"[A-Za-z0-9._-]+", requirement) for requirement in requirements)
    return {m.group(0).lower() for m in match if m}


def _python(code: str) -> subprocess.CompletedProcess[str]:
    # A fresh interpreter in the checkout: what this process imported does not count.
    return subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True,
                          text=True, timeout=120)


def test_the_core_dependencies_leave_the_benchmarks_own_out() -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())["project"]
    extras = project["optional-dependencies"]
    assert not _names(project["dependencies"]) & BENCH_ONLY
    assert _names(extras["bench"]) >= BENCH_ONLY
    assert "tiergate[bench]" in extras["test"]  # the tests import the benchmarks


def test_serving_imports_neither_the_bench_package_nor_its_dependencies() -> None:
    code = """
import json, sys
import gateway.server.app, gateway.server.serve, gateway.cli
gateway.cli.build_parser().parse_args(["serve"])
print(json.dumps(sorted(m for m in sys.modules if m.split(".")[0] in
                        {"aiohttp", "matplotlib", "bench"})))
"""
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout) == []


def test_a_benchmark_is_imported_when_its_subcommand_is_chosen() -> None:
    code = """
import sys
import gateway.cli
gateway.cli.build_parser().parse_args(["bench", "engine", "--steps", "3"])
print("bench.engine" in sys.modules, "bench.serve.command" in sys.modules)
"""
    done = _python(code)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["True", "False"]


def test_a_benchmark_without_the_extra_names_it_and_fails() -> None:
    # None in sys.modules: the import system answers as if the package were not installed.
    code = """
import sys
sys.modules["aiohttp"] = sys.modules["matplotlib"] = None
import gateway.cli
sys.exit(gateway.cli.main(["bench", "serve", "--url", "http://127.0.0.1:9"]))
"""
    done = _python(code)
    assert done.returncode != 0
    (line,) = done.stderr.splitlines()
    assert line.startswith("tiergate bench serve: aiohttp, matplotlib not installed")
    assert line.endswith(INSTALL_HINT)
