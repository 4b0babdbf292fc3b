"""`tiergate bench admission` on a small mix: every row timed, the table and JSON printed."""

from __future__ import annotations

import json

import pytest

from bench import admission as bench_admission
from gateway.cli import main


def test_decision_latency_micro_benchmark() -> None:
    """Prints how long decisions take; asserts nothing about time (CI machines vary)."""
    rows = bench_admission.measure_decision_latency(num_decisions=2000, seed=1)
    print("\n" + bench_admission.format_latency_table(rows))
    assert [row.name for row in rows] == [
        "budget check",
        "SLO shed decision",
        "rate limits (memory)",
        "admit (memory limiter, all checks)",
    ]
    assert all(row.num_decisions == 2000 and 0 < row.p50_us <= row.p99_us for row in rows)


def test_the_cli_prints_the_rows_as_json(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["bench", "admission", "--decisions", "200", "--seed", "2", "--json"]) == 0
    out = json.loads(capsys.readouterr().out)
    assert out["seed"] == 2
    assert [row["num_decisions"] for row in out["rows"]] == [200] * 4
