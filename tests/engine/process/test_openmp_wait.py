"""engine.process.openmp_wait: the engine process's OpenMP workers spin a bounded while, unless the
deployment says otherwise; the caller's own environment is left as it was."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from engine.process.engine_process import EngineProcess
from engine.process.openmp_wait import (
    ENGINE_SPIN_COUNT,
    engine_openmp_environment,
    spawn_environment,
)
from tests.engine.helpers import sleeping_engine


def _environment_of(pid: int) -> dict[str, str]:
    raw = Path(f"/proc/{pid}/environ").read_bytes()
    pairs = (entry.split(b"=", 1) for entry in raw.split(b"\0") if b"=" in entry)
    return {name.decode(): value.decode() for name, value in pairs}


def test_the_bounded_spin_only_where_the_environment_says_nothing() -> None:
    assert engine_openmp_environment({"PATH": "/bin"}) == {"GOMP_SPINCOUNT": str(ENGINE_SPIN_COUNT)}
    assert engine_openmp_environment({"OMP_WAIT_POLICY": "PASSIVE"}) == {}
    assert engine_openmp_environment({"GOMP_SPINCOUNT": "0"}) == {}


def test_spawn_environment_restores_what_was_there(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TIERGATE_TEST_KEPT", "before")
    monkeypatch.delenv("TIERGATE_TEST_ADDED", raising=False)
    with spawn_environment({"TIERGATE_TEST_KEPT": "during", "TIERGATE_TEST_ADDED": "during"}):
        assert os.environ["TIERGATE_TEST_KEPT"] == os.environ["TIERGATE_TEST_ADDED"] == "during"
    assert os.environ["TIERGATE_TEST_KEPT"] == "before"
    assert "TIERGATE_TEST_ADDED" not in os.environ


@pytest.mark.parametrize(
    ("given", "expected"),
    [
        ({}, {"GOMP_SPINCOUNT": str(ENGINE_SPIN_COUNT)}),
        ({"OMP_WAIT_POLICY": "PASSIVE"}, {"OMP_WAIT_POLICY": "PASSIVE"}),
        ({"GOMP_SPINCOUNT": "250"}, {"GOMP_SPINCOUNT": "250"}),
    ],
)
def test_the_engine_process_starts_with_the_wait_and_this_process_keeps_its_own(
    monkeypatch: pytest.MonkeyPatch, given: dict[str, str], expected: dict[str, str]
) -> None:
    for name in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT"):
        monkeypatch.delenv(name, raising=False)
    for name, value in given.items():
        monkeypatch.setenv(name, value)
    before = dict(os.environ)
    process = EngineProcess(sleeping_engine)
    try:
        assert process.pid is not None
        seen = _environment_of(process.pid)
    finally:
        process.shutdown()
    assert {k: v for k, v in seen.items() if k in ("OMP_WAIT_POLICY", "GOMP_SPINCOUNT")} == expected
    assert dict(os.environ) == before
