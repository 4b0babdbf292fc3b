"""`tiergate bench engine` on small sizes, host and device halves."""

from __future__ import annotations

import argparse
import json

import pytest
import torch

from bench import device as bench_device
from bench import engine as bench_engine
from bench import sampler as bench_sampler
from engine import SamplingParams
from engine.models.config import ModelConfig
from engine.testing.no_work_runner import NoWorkRunner


def test_decode_and_short_measurements_run_the_engine() -> None:
    assert bench_engine.measure_decode(8, 64, num_steps=5, seed=1) > 0
    assert bench_engine.measure_short(8, seed=1) > 0
    decode, short = bench_engine.run([1, 4], context=32, num_steps=3, num_short=4, repeats=2,
                                     seed=0)
    assert [r.num_running for r in decode] == [1, 4]
    for row in decode:
        assert row.step_us_min <= row.step_us <= row.step_us_max
        assert row.per_request_us == pytest.approx(row.step_us / row.num_running)
    assert short.num_requests == 4 and short.per_request_us > 0
    table = bench_engine.format_table(decode, short, 32, 2)
    assert "| 4 |" in table and "us per running request" in table
    assert "synchronous scheduling, fcfs policy," in table


def test_the_tiered_policy_runs_the_same_measurements_over_tenants_in_tiers() -> None:
    assert bench_engine.measure_decode(8, 64, num_steps=5, seed=1, policy="tiered") > 0
    assert bench_engine.measure_short(8, seed=1, policy="tiered") > 0
    engine = bench_engine._engine(8, 64, False, "tiered")
    assert type(engine.scheduler.policy).__name__ == "TieredPolicy"
    with pytest.raises(ValueError, match="unknown policy"):
        bench_engine._engine(8, 64, False, "lottery")


def test_sampler_measurement_samples_every_kind() -> None:
    for kind in bench_sampler.KINDS:
        assert bench_sampler.measure(kind, 9, num_steps=3, seed=0) > 0
    rows = bench_sampler.run([1, 5], num_steps=2, repeats=2, seed=0)
    assert [(r.kind, r.num_rows) for r in rows] == [
        (kind, n) for kind in bench_sampler.KINDS for n in (1, 5)
    ]
    for row in rows:
        assert row.step_us_min <= row.step_us <= row.step_us_max
    assert "| 5 | mixed |" in bench_sampler.format_table(rows, 2)


def test_json_report(capsys: pytest.CaptureFixture[str]) -> None:
    parser = argparse.ArgumentParser()
    bench_engine.add_arguments(parser)
    args = parser.parse_args(["--batches", "2", "--context", "20", "--steps", "2",
                              "--short-requests", "3", "--repeats", "1", "--json",
                              "--async-scheduling"])
    assert bench_engine.report(args) == 0
    result = json.loads(capsys.readouterr().out)
    assert [r["num_running"] for r in result["decode"]] == [2]
    assert [(r["kind"], r["num_rows"]) for r in result["sampler"]] == [
        (kind, 2) for kind in bench_sampler.KINDS
    ]
    assert result["short"]["num_requests"] == 3
    assert result["async_scheduling"] is True
    assert result["policy"] == "fcfs"


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
def test_no_work_runner_builds_the_inputs_of_every_token(async_scheduling: bool) -> None:
    engine = bench_engine._engine(2, 40, async_scheduling)
    runner = engine.runner
    assert isinstance(runner, NoWorkRunner)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    engine.add_request("a", list(range(3, 40)), params)
    engine.add_request("b", list(range(5, 15)), params)
    tokens = []
    while engine.has_unfinished_requests():
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    assert tokens == [runner.token_id] * 6
    # 37 + 10 prompt tokens, then two decode steps of two tokens
    assert runner.num_tokens_built == 37 + 10 + 2 * 2


def test_device_rows_on_the_cpu_with_a_tiny_model(capsys: pytest.CaptureFixture[str]) -> None:
    """The device half runs anywhere: here the CPU, the bench model, a few steps."""
    parser = argparse.ArgumentParser()
    bench_engine.add_arguments(parser)
    args = parser.parse_args(["--batches", "1", "3", "--context", "40", "--steps", "2",
                              "--short-requests", "2", "--repeats", "1", "--device", "cpu",
                              "--dtype", "float32", "--device-steps", "6",
                              "--copy-bytes", str(1 << 22), "--json"])
    assert bench_engine.report(args) == 0
    device = json.loads(capsys.readouterr().out)["device"]
    assert [r["num_running"] for r in device["rows"]] == [1, 3]
    config = ModelConfig.from_file(args.model_config)
    weights = bench_device.weight_bytes_per_step(config, torch.float32)
    for row in device["rows"]:
        assert row["step_ms"] > 0 and row["step_sync_ms"] > 0 and row["forward_ms"] > 0
        # the weights once, plus K and V of every layer for each context token: 40 at the
        # start, then one more a step (six timed, six warming up, a few ahead)
        kv_per_token = 2 * config.num_layers * config.kv_size * 4
        num_kv = (row["bytes_read"] - weights) / (kv_per_token * row["num_running"])
        assert 40 <= num_kv <= 40 + 6 + 6 + 4
    e, q, kv, i = config.hidden_size, config.q_size, config.kv_size, config.intermediate_size
    per_layer = e * (q + 2 * kv) + q * e + 3 * e * i  # q/k/v, o, gate/up/down
    assert weights == 4 * (config.num_layers * per_layer + config.vocab_size * e)
