"""ops/bench/inputs: the benchmark inputs the repository carries. Every benchmark default
names a file there, found from the code's own place, so a clone runs them from any
directory without the shared folder beside it."""

from __future__ import annotations

import argparse
import re
from pathlib import Path

import pytest

from bench import offline as bench_offline
from bench.serve import command
from bench.workload import BENCH_INPUTS, Workload
from engine.models.config import ModelConfig

REPO = Path(__file__).resolve().parents[2]


def test_the_inputs_are_in_the_repository() -> None:
    assert BENCH_INPUTS == REPO / "ops" / "bench" / "inputs"
    names = {p.name for p in BENCH_INPUTS.iterdir()}
    assert {"README.md", "bench-model.json", "workload-offline-200.json",
            "workload-serve-600.json"} <= names


def test_every_benchmark_default_loads_from_another_directory(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.chdir(tmp_path)
    serve = argparse.ArgumentParser()
    command.add_arguments(serve)
    offline = argparse.ArgumentParser()
    bench_offline.add_arguments(offline)
    serve_args, offline_args = serve.parse_args([]), offline.parse_args([])

    assert serve_args.workload == BENCH_INPUTS / "workload-serve-600.json"
    workload = Workload.load(serve_args.workload)
    assert (len(workload.requests), workload.rate_rps) == (600, 1.0)

    assert offline_args.workload == BENCH_INPUTS / "workload-offline-200.json"
    workload = Workload.load(offline_args.workload)
    assert len(workload.requests) == 200
    assert {r.arrival_s for r in workload.requests} == {0.0}
    # A limit past the file's end cycles through it again (the GPU benchmark's 256 requests).
    first = Workload.load(offline_args.workload, limit=64).requests
    cycled = Workload.load(offline_args.workload, limit=456).requests
    assert cycled[:64] == first and len({r.request_id for r in cycled}) == 456
    assert cycled[456 - 1].request_id == workload.requests[55].request_id + "~2"
    assert [r.prompt_len for r in cycled[200:400]] == [r.prompt_len for r in workload.requests]

    assert offline_args.model_config == BENCH_INPUTS / "bench-model.json"
    assert ModelConfig.from_file(offline_args.model_config).num_layers == 8


def test_make_sim_replays_the_repositorys_workload() -> None:
    recipe = re.search(r"^sim:.*\n\t(.+)$", (REPO / "Makefile").read_text(), re.MULTILINE)
    assert recipe is not None
    workload = re.search(r"--workload (\S+)", recipe.group(1))
    assert workload is not None
    assert (REPO / workload.group(1)).resolve() == BENCH_INPUTS / "workload-serve-600.json"
