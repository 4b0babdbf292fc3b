"""`tiergate bench serve`: prompt planning and statistics on hand-made inputs, then tiny
benchmarks against real `tiergate serve` processes started by the tool itself (a run, the
command line against --url, and a whole sweep). Nothing here gates on time: latency figures
are checked for consistency with each other, never against a bound."""

from __future__ import annotations

import asyncio
import dataclasses
import gc
import json
import math
import os
import signal
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import replace
from pathlib import Path

import pytest
from prometheus_client import generate_latest

from bench.serve.calibration import (
    REFERENCE_PROMPT_LEN,
    Calibration,
    CapacityAttempt,
    calibration_of,
    capacity_window,
    measure_capacity,
    measure_reference_prefill_s,
)
from bench.serve.engine_activity import (
    EngineActivity,
    engine_activity_of,
    read_engine_activity,
)
from bench.serve.errors import BenchConfigError
from bench.serve.loadgen import CANCELLED, ClientLoopLag, LoadGenerator, RequestResult
from bench.serve.machine import CpuTicks, MachineInfo, read_cpu_ticks
from bench.serve.plan import (
    HEAVY_TENANT,
    LIGHT_TENANT,
    ArrivalProcess,
    PlannedRequest,
    PromptVocabulary,
    plan_requests,
    retime,
    two_tenant_workload,
)
from bench.serve.report import format_run, format_sweep, headline, run_json
from bench.serve.server import VARIANTS, BenchServer, EngineLimits
from bench.serve.server_process import process_tree_cpu_s
from bench.serve.session import BenchTarget, RunRecord
from bench.serve.stats import RunSummary, meets_slo, summarize
from bench.serve.sweep import FairnessRun, LoadPoint, SweepResult, run_order
from bench.serve.sweep_config import (
    MIN_RUN_DURATION_S,
    OBJECTIVES_PER_RUN,
    SweepConfig,
    run_duration_s,
)
from bench.workload import Workload, WorkloadRequest
from gateway import cli
from gateway.observability.loop_lag import LoopStall
from gateway.observability.metrics import GatewayMetrics
from policies import DEFAULT_TIERS, TierTable
from tests.engine.helpers import preempting_engine
from tests.serve_process import shared_demo_model_dir

# -- planning --------------------------------------------------------------------------------


def _request(
    index: int, tenant: str, arrival_s: float, prompt_len: int = 24, output_len: int = 6,
    prefix: int = 0, tier: str = "premium",
) -> WorkloadRequest:
    return WorkloadRequest(f"r{index}", arrival_s, tenant, tier, prompt_len, output_len, prefix)


def test_prompts_avoid_special_ids_and_share_each_tenants_prefix() -> None:
    workload = Workload(seed=3, rate_rps=1.0, requests=[
        _request(0, "a", 0.5, prompt_len=30, prefix=16),
        _request(1, "b", 0.2, prompt_len=30, prefix=16),
        _request(2, "a", 0.9, prompt_len=20, prefix=16),
        _request(3, "a", 1.3, prompt_len=40, prefix=0),
    ])
    vocabulary = PromptVocabulary(vocab_size=40, special_token_ids=frozenset({0, 1, 2, 3, 4, 39}))
    plan = plan_requests(workload, vocabulary)
    assert [p.request_id for p in plan] == ["r1", "r0", "r2", "r3"]  # arrival order
    by_id = {p.request_id: p for p in plan}
    for p in plan:
        assert all(5 <= t < 39 for t in p.prompt_token_ids), p
        assert p.num_output_tokens == 6
    assert [len(by_id[f"r{i}"].prompt_token_ids) for i in range(4)] == [30, 30, 20, 40]
    assert by_id["r0"].prompt_token_ids[:16] == by_id["r2"].prompt_token_ids[:16]
    assert by_id["r0"].prompt_token_ids[:16] != by_id["r1"].prompt_token_ids[:16]
    assert by_id["r0"].prompt_token_ids[16:20] != by_id["r2"].prompt_token_ids[16:20]
    assert plan_requests(workload, vocabulary) == plan  # seeded
    # The whole ordinary range is reachable: no id is lost in the mapping.
    many = Workload(seed=0, rate_rps=1.0, requests=[_request(0, "a", 0.0, prompt_len=2000)])
    assert set(plan_requests(many, vocabulary)[0].prompt_token_ids) == set(range(5, 39))


def test_demo_model_vocabulary_excludes_its_special_tokens() -> None:
    vocabulary = PromptVocabulary.of_model(shared_demo_model_dir())
    config = json.loads((shared_demo_model_dir() / "config.json").read_text())
    assert vocabulary.vocab_size == config["vocab_size"]
    assert vocabulary.special_token_ids == frozenset(range(5))  # bos, eos, headers, eot


def test_retime_scales_the_files_arrivals_to_the_rate() -> None:
    workload = Workload(seed=0, rate_rps=1.0, requests=[
        _request(i, "a", t) for i, t in enumerate([0.5, 1.0, 2.0, 4.0])
    ])
    doubled = retime(workload, 2.0)
    assert [r.arrival_s for r in doubled.requests] == [0.25, 0.5, 1.0, 2.0]
    assert doubled.rate_rps == 2.0
    assert [r.request_id for r in retime(workload, 2.0, duration_s=1.0).requests] == ["r0", "r1"]
    assert len(retime(workload, 0.5, num_requests=3).requests) == 3
    with pytest.raises(BenchConfigError):
        retime(workload, 1.0, duration_s=0.1)


def test_a_run_longer_than_the_file_takes_the_file_again_with_new_prompts() -> None:
    workload = Workload(seed=0, rate_rps=1.0, requests=[
        _request(i, "a", t, prompt_len=10 + i) for i, t in enumerate([0.5, 1.0, 2.0, 4.0])
    ])
    timed = retime(workload, 2.0, duration_s=5.0)  # 10 requests from a file of 4
    assert [r.request_id for r in timed.requests] == [
        "r0", "r1", "r2", "r3", "r0~1", "r1~1", "r2~1", "r3~1", "r0~2", "r1~2",
    ]
    assert [r.prompt_len for r in timed.requests] == [10, 11, 12, 13] * 2 + [10, 11]
    times = [r.arrival_s for r in timed.requests]
    assert times == sorted(times) and len(set(times)) == len(times)
    assert times[-1] == pytest.approx(5.0)  # the last at count / rate
    prompts = timed.prompts(1000)
    assert prompts["r0"] != prompts["r0~1"] and len(prompts["r0~1"]) == 10
    poisson = retime(workload, 20.0, arrivals=ArrivalProcess.POISSON, duration_s=10.0, seed=3)
    assert len(poisson.requests) == pytest.approx(200, rel=0.2)
    assert max(r.arrival_s for r in poisson.requests) < 10.0
    assert len({r.request_id for r in poisson.requests}) == len(poisson.requests)


def test_poisson_arrivals_are_seeded_at_the_asked_rate() -> None:
    workload = Workload(seed=0, rate_rps=1.0, requests=[
        _request(i, "a", float(i)) for i in range(4000)
    ])
    first = retime(workload, 5.0, arrivals=ArrivalProcess.POISSON, seed=7)
    again = retime(workload, 5.0, arrivals=ArrivalProcess.POISSON, seed=7)
    other = retime(workload, 5.0, arrivals=ArrivalProcess.POISSON, seed=8)
    times = [r.arrival_s for r in first.requests]
    assert times == [r.arrival_s for r in again.requests]
    assert times != [r.arrival_s for r in other.requests]
    assert times == sorted(times)
    assert len(times) / times[-1] == pytest.approx(5.0, rel=0.05)


def test_two_tenant_workload_keeps_the_rate_ratio() -> None:
    workload = Workload(seed=0, rate_rps=1.0, requests=[
        _request(i, "x", float(i), prompt_len=10 + i) for i in range(3000)
    ])
    mixed = two_tenant_workload(workload, 2.0, 10.0, 100.0, seed=1)
    light = [r for r in mixed.requests if r.tenant == "light"]
    heavy = [r for r in mixed.requests if r.tenant == "heavy"]
    assert {r.tier for r in mixed.requests} == {"standard"}
    assert 8 < len(heavy) / len(light) < 12.5
    assert len(light) == pytest.approx(200, rel=0.2)
    times = [r.arrival_s for r in mixed.requests]
    assert times == sorted(times) and times[-1] < 100.0
    # Lengths come from the workload's requests in order.
    assert [r.prompt_len for r in mixed.requests[:3]] == [10, 11, 12]
    assert len({r.request_id for r in mixed.requests}) == len(mixed.requests)
    # More arrivals than the file has requests: the file's lengths again.
    short = Workload(seed=0, rate_rps=1.0, requests=workload.requests[:50])
    longer = two_tenant_workload(short, 2.0, 10.0, 100.0, seed=1)
    assert len(longer.requests) == len(mixed.requests) > 50
    assert [r.prompt_len for r in longer.requests[50:53]] == [10, 11, 12]


# -- statistics ------------------------------------------------------------------------------


def _result(
    request_id: str, tenant: str, tier: str, sent_s: float, status: int, *, ttft_s: float | None,
    num_tokens: int, num_requested: int, itl_s: list[float], e2e_s: float, lag_s: float = 0.0,
    error: str | None = None, server_s: float | None = None,
) -> RequestResult:
    return RequestResult(
        request_id=request_id, tenant=tenant, tier=tier, scheduled_s=sent_s - lag_s,
        sent_s=sent_s, status_code=status, num_prompt_tokens=10,
        num_output_tokens_requested=num_requested, num_output_tokens=num_tokens, ttft_s=ttft_s,
        e2e_s=e2e_s, itl_s=itl_s, error=error, server_s=server_s,
    )


def test_a_load_run_spans_five_of_the_slowest_objectives_and_at_least_20_s() -> None:
    # The default table: standard's TTFT objective (2 s) is the slowest with one.
    assert run_duration_s(TierTable()) == MIN_RUN_DURATION_S == 20.0
    assert run_duration_s(TierTable().scaled(2.18)) == pytest.approx(21.8)  # 5 x 4.36 s
    assert run_duration_s(TierTable().scaled(4.0)) == pytest.approx(OBJECTIVES_PER_RUN * 8.0)
    no_objectives = TierTable([replace(t, ttft_slo_s=None) for t in TierTable()])
    assert run_duration_s(no_objectives) == 20.0
    vocabulary = PromptVocabulary(vocab_size=40, special_token_ids=frozenset({0}))
    workload = Workload(seed=0, rate_rps=1.0, requests=[])
    limits = EngineLimits(model_dir=None, demo_model_dir=Path("."))
    for duration_s in (0.0, -1.0):
        with pytest.raises(BenchConfigError, match="durations must be positive"):
            SweepConfig(workload, vocabulary, limits, Path("."), duration_s=duration_s)
    for field_name in ("repeats", "num_calibrations"):
        with pytest.raises(BenchConfigError, match="at least 1"):
            SweepConfig(workload, vocabulary, limits, Path("."), **{field_name: 0})
    with pytest.raises(BenchConfigError, match="measured every turn cannot also be given"):
        SweepConfig(workload, vocabulary, limits, Path("."), capacity_rps=3.0,
                    capacity_each_turn=True)


def test_the_collector_stays_out_of_a_run() -> None:
    """A collection in the generator pauses its event loop, counted in the latencies it
    measures: automatic collection is off during a run, and on again after it."""
    collector_enabled: list[bool] = []
    refusal = b'{"error": {"message": "overloaded", "type": "x", "param": null, "code": null}}'

    async def answer(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        head = await reader.readuntil(b"\r\n\r\n")
        length = next(int(line.split(b":")[1]) for line in head.split(b"\r\n")
                      if line.lower().startswith(b"content-length:"))  # fmt: skip
        await reader.readexactly(length)
        collector_enabled.append(gc.isenabled())
        writer.write(b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
                     b"content-length: %d\r\nconnection: close\r\n\r\n%s"
                     % (len(refusal), refusal))  # fmt: skip
        await writer.drain()
        writer.close()

    async def main() -> list[RequestResult]:
        server = await asyncio.start_server(answer, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
        plan = [PlannedRequest(f"r{i}", "t", "standard", 0.01 * i, (5, 6, 7), 2)
                for i in range(3)]  # fmt: skip
        generator = LoadGenerator(f"http://127.0.0.1:{port}", "m", {"t": "key"}, progress=False)
        async with server:
            return await generator.run(plan)

    assert gc.isenabled()
    results = asyncio.run(main())
    assert [r.status_code for r in results] == [429] * 3
    assert collector_enabled == [False] * 3
    assert gc.isenabled()


def test_summary_figures_from_hand_made_results() -> None:
    tiers = TierTable()  # premium TTFT 0.5 s, TPOT 0.05 s; standard 2 s, 0.1 s
    results = [
        # meets both: TPOT (0.56 - 0.2) / 9 = 0.04
        _result("p1", "pa", "premium", 0.0, 200, ttft_s=0.2, num_tokens=10, num_requested=10,
                itl_s=[0.04] * 9, e2e_s=0.56),
        # TTFT over 0.5 s
        _result("p2", "pb", "premium", 1.0, 200, ttft_s=0.6, num_tokens=5, num_requested=5,
                itl_s=[0.1] * 4, e2e_s=1.0, lag_s=0.05),
        # TTFT met, TPOT (3.0 - 1.0) / 10 = 0.2 over 0.1 s
        _result("s1", "sa", "standard", 0.5, 200, ttft_s=1.0, num_tokens=11, num_requested=11,
                itl_s=[0.2] * 10, e2e_s=3.0),
        _result("s2", "sa", "standard", 2.0, 429, ttft_s=None, num_tokens=0, num_requested=8,
                itl_s=[], e2e_s=0.01, error="overloaded"),
        # the stream broke after 3 of 8 tokens
        _result("s3", "sb", "standard", 1.5, 200, ttft_s=0.5, num_tokens=3, num_requested=8,
                itl_s=[0.25, 0.25], e2e_s=1.0, error="engine failed"),
    ]
    assert [meets_slo(r, tiers) for r in results] == [True, False, False, False, False]
    summary = summarize("hand", 2.5, results, tiers)
    assert summary.duration_s == pytest.approx(3.5)  # s1 ends last, at 0.5 + 3.0
    assert summary.max_send_lag_s == pytest.approx(0.05)
    overall = summary.overall
    assert (overall.num_requests, overall.num_completed, overall.num_shed, overall.num_failed) \
        == (5, 3, 1, 1)
    assert overall.goodput_rps == pytest.approx(1 / 3.5)
    assert overall.shed_rate == pytest.approx(0.2)
    assert overall.output_tokens_per_s == pytest.approx(29 / 3.5)
    assert overall.itl_s.num_samples == 9 + 4 + 10 + 2
    assert overall.shed_response_s.p99 == pytest.approx(0.01)
    premium = summary.tier("premium")
    assert (premium.ttft_s.p50, premium.ttft_s.p90, premium.ttft_s.p99) == (0.2, 0.6, 0.6)
    assert premium.ttft_slo_attainment == 0.5 and premium.slo_attainment == 0.5
    assert premium.tpot_s.p99 == pytest.approx(0.1)
    standard = summary.tier("standard")
    assert standard.ttft_slo_attainment == pytest.approx(2 / 3)
    assert standard.slo_attainment == 0.0 and standard.goodput_rps == 0.0
    assert standard.e2e_s.num_samples == 1  # completed only
    assert [t.name for t in summary.tenants] == ["pa", "pb", "sa", "sb"]
    assert summary.tenant("sa").num_shed == 1
    assert math.isnan(summary.tenant("sb").e2e_s.p50)
    document = run_json(RunRecord(summary, results))
    assert document["summary"]["tenants"][3]["e2e_s"]["p50"] is None  # NaN -> null
    assert document["requests"][0]["num_token_gaps"] == 9
    json.dumps(document, allow_nan=False)
    assert "hand" in format_run(RunRecord(summary, results))


def test_tokens_while_arrivals_last_leave_out_the_drain_after_them() -> None:
    def run(label: str, drain_gaps: int) -> RunSummary:
        # sends at 0, 1 and 2 s: the arrivals last 2 s
        return summarize(label, 1.5, [
            # tokens at 0.5 .. 2.0 s inside the window, then drain_gaps more after it
            _result("a", "t", "standard", 0.0, 200, ttft_s=0.5, num_tokens=4 + drain_gaps,
                    num_requested=4 + drain_gaps, itl_s=[0.5] * (3 + drain_gaps),
                    e2e_s=2.0 + 0.5 * drain_gaps),
            # tokens at 1.25, 1.5, 1.75, 2.0 s
            _result("b", "t", "standard", 1.0, 200, ttft_s=0.25, num_tokens=4, num_requested=4,
                    itl_s=[0.25] * 3, e2e_s=1.0),
            _result("c", "t", "standard", 2.0, 429, ttft_s=None, num_tokens=0, num_requested=4,
                    itl_s=[], e2e_s=0.01, error="overloaded"),
        ], TierTable())  # fmt: skip

    shedding, draining = run("tiered @ 2x", 0), run("fcfs @ 2x", 8)
    assert shedding.arrival_window_s == draining.arrival_window_s == pytest.approx(2.0)
    # the same 8 tokens while arrivals last, whatever comes after
    assert shedding.output_tokens_per_s_while_arriving == pytest.approx(4.0)
    assert draining.output_tokens_per_s_while_arriving == pytest.approx(4.0)
    assert shedding.overall.output_tokens_per_s == pytest.approx(8 / 2.01)  # c ends last
    assert draining.overall.output_tokens_per_s == pytest.approx(16 / 6.0)
    calibration = Calibration(slo_scale=1.0, capacity_rps=1.0)
    machine = MachineInfo("cpu", 2, 24.0, "Linux", "3.11", "2.13.0", "now", 0.0)
    points = [
        LoadPoint(variant, 2.0, 0, 0.0, None, RunRecord(summary, []))
        for variant, summary in [("tiered", shedding), ("fcfs", draining)]
    ]
    (line,) = headline(SweepResult(machine, calibration, TierTable(), 20.0, points))
    assert "output tokens/s tiered/FCFS 1.493 over the run, 1.000 while arrivals last" in line
    # With a measured capacity, FCFS's rate at 2x checks it: here FCFS ran at half of it.
    measured = replace(calibration, capacity_attempts=[CapacityAttempt(1.0, 8.0, 1.0, 2, None)])
    lines = headline(SweepResult(machine, measured, TierTable(), 20.0, points))
    assert lines[1] == ("capacity check: FCFS output tokens/s while arrivals last 4 at 2x "
                        "(0.50), against the calibration's 8")
    # Measured again before the turn: FCFS's rate against that turn's capacity run.
    turn = CapacityAttempt(0.5, 5.0, 1.0, 2, None)
    remeasured = [replace(p, turn_capacity=turn) for p in points]
    result = SweepResult(machine, measured, TierTable(), 20.0, remeasured)
    assert headline(result)[1] == ("capacity check: FCFS output tokens/s while arrivals last "
                                   "4 at 2x (0.80), against its turn's capacity run")
    assert result.capacity_rps_for(remeasured[0].turn_capacity) == 0.5
    assert result.capacity_rps_for(points[0].turn_capacity) == measured.capacity_rps == 1.0


def test_calibration_keeps_the_middle_attempt_of_each_figure() -> None:
    """A fast outlier among three attempts (run 54: 2,806 output tokens/s against 2,483 and
    2,432) moves neither figure; of two attempts the faster is kept."""
    def attempt(tokens_per_s: float) -> CapacityAttempt:
        return CapacityAttempt(tokens_per_s / 100, tokens_per_s, 10.0, 64, None)

    prefills = [[0.083, 0.084, 0.090], [0.065, 0.060, 0.070], [0.087, 0.080, 0.088]]
    capacities = [attempt(2483.0), attempt(2806.0), attempt(2432.0)]
    three = Calibration(1.0, 1.0, prefills, capacities)
    assert three.reference_prefill_s == pytest.approx(0.084)  # medians 0.084, 0.065, 0.087
    assert three.capacity == capacities[0]
    two = Calibration(1.0, 1.0, prefills[:2], capacities[:2])
    assert two.reference_prefill_s == pytest.approx(0.065)
    assert two.capacity == capacities[1]
    one = Calibration(1.0, 1.0, prefills[2:], capacities[2:])
    assert (one.reference_prefill_s, one.capacity) == (pytest.approx(0.087), capacities[2])


def test_runs_alternate_between_configurations_from_one_repetition_to_the_next() -> None:
    assert run_order(["tiered", "fcfs"], [1.0, 2.0], 3) == [
        (1.0, 0, "tiered"), (1.0, 0, "fcfs"),
        (1.0, 1, "fcfs"), (1.0, 1, "tiered"),
        (1.0, 2, "tiered"), (1.0, 2, "fcfs"),
        (2.0, 0, "fcfs"), (2.0, 0, "tiered"),
        (2.0, 1, "tiered"), (2.0, 1, "fcfs"),
        (2.0, 2, "fcfs"), (2.0, 2, "tiered"),
    ]  # fmt: skip
    # One repetition: the order rotates from one load to the next, as it always did.
    assert run_order(["a", "b", "c"], [0.5, 1.0], 1) == [
        (0.5, 0, "a"), (0.5, 0, "b"), (0.5, 0, "c"), (1.0, 0, "b"), (1.0, 0, "c"), (1.0, 0, "a")
    ]  # fmt: skip


def test_repetitions_are_reported_together_then_each() -> None:
    def premium(sent_s: float, ttft_s: float, num_tokens: int) -> RequestResult:
        return _result("a", "p", "premium", sent_s, 200, ttft_s=ttft_s, num_tokens=num_tokens,
                       num_requested=num_tokens, itl_s=[0.04] * (num_tokens - 1),
                       e2e_s=ttft_s + 0.04 * (num_tokens - 1))  # fmt: skip

    def standard(sent_s: float) -> RequestResult:  # within both objectives, 3 tokens
        return _result("b", "s", "standard", sent_s, 200, ttft_s=0.5, num_tokens=3,
                       num_requested=3, itl_s=[0.1, 0.1], e2e_s=0.7)  # fmt: skip

    shed = _result("c", "s", "standard", 3.0, 429, ttft_s=None, num_tokens=0, num_requested=3,
                   itl_s=[], e2e_s=0.01, error="overloaded")  # fmt: skip

    def point(variant: str, repeat: int, results: list[RequestResult]) -> LoadPoint:
        record = RunRecord(summarize(variant, 2.0, results, TierTable()), results)
        return LoadPoint(variant, 2.0, repeat, 0.0, None, record)

    # Repetition 1, arrivals over [0, 1] s: tiered's 3 tokens in them, FCFS's 4 (its
    # premium request over its 0.5-s objective); both 1.7 s long, one good standard request.
    # Repetition 2, arrivals over [0, 3] s: tiered's 2 tokens, FCFS's 3; tiered shed its
    # standard request (3.01 s long), FCFS served it (3.7 s).
    points = [
        point("tiered", 0, [premium(0.0, 0.2, 3), standard(1.0)]),
        point("fcfs", 0, [premium(0.0, 0.6, 4), standard(1.0)]),
        point("fcfs", 1, [premium(0.0, 0.2, 3), standard(3.0)]),
        point("tiered", 1, [premium(0.0, 0.2, 2), shed]),
    ]
    machine = MachineInfo("cpu", 2, 24.0, "Linux", "3.11", "2.13.0", "now", 0.0)
    calibration = Calibration(slo_scale=1.0, capacity_rps=1.0,
                              capacity_attempts=[CapacityAttempt(1.0, 8.0, 1.0, 2, None)])
    result = SweepResult(machine, calibration, TierTable(), 20.0, points)
    assert result.repeats == 2
    # Together: premium 2 of 2 against 1 of 2; standard goodput (1 + 0) / (1.7 + 3.01) s
    # against 2 / (1.7 + 3.7) s; tokens over the runs 8 / 4.71 s against 13 / 5.4 s, while
    # arrivals last 5 / 4 s against 7 / 4 s. Each: 3/4 and 2/3 of FCFS's tokens.
    assert headline(result)[:3] == [
        "at 2x, 2 repetitions together: premium TTFT within SLO 100.0 % tiered vs 50.0 % "
        "FCFS; standard goodput tiered/FCFS 0.573; output tokens/s tiered/FCFS 0.706 over the "
        "run, 0.714 while arrivals last",
        "  each repetition: premium 100.0/0.0, 100.0/100.0 %; standard goodput 1.000, 0.000; "
        "output tokens/s while arrivals last 0.750, 0.667 (mean 0.708, sd 0.059)",
        "shed requests answered: 1 at 2x, slowest 10.0 ms",
    ]
    assert headline(result)[3] == (
        "capacity check: FCFS output tokens/s while arrivals last 4 at 2x #1 (0.50), "
        "1 at 2x #2 (0.12), against the calibration's 8"
    )

    def light(ttft_s: float) -> RequestResult:
        return _result("l", LIGHT_TENANT, "standard", 0.0, 200, ttft_s=ttft_s, num_tokens=1,
                       num_requested=1, itl_s=[], e2e_s=ttft_s)  # fmt: skip

    def fairness(repeat: int, alone: list[float], shared: list[float]) -> FairnessRun:
        def record(results: list[RequestResult]) -> RunRecord:
            return RunRecord(summarize("f", 1.0, results, TierTable()), results)

        heavy = replace(light(0.1), tenant=HEAVY_TENANT)
        return FairnessRun("tiered", repeat, 0.5, 5.0, record([light(t) for t in alone]),
                           record([heavy, *(light(t) for t in shared)]))

    runs = [fairness(0, [0.1, 0.2], [0.2, 0.4]), fairness(1, [0.3], [0.5])]
    assert [run.light_ttft_p99_ratio for run in runs] == [2.0, pytest.approx(5 / 3)]
    table = format_sweep(replace(result, fairness=runs)).splitlines()
    rows = {line.split("  ")[0]: line.split() for line in table if line.startswith("tiered")}
    assert rows["tiered #1"][4:12] == ["2", "0.100", "0.200", "0.200", "0.200", "0.400",
                                       "0.400", "2.00"]  # fmt: skip
    # Every repetition's light requests together: p99 0.5 s shared against 0.3 s alone.
    assert rows["tiered, all 2"][5:13] == ["3", "0.200", "0.300", "0.300", "0.400", "0.500",
                                           "0.500", "1.67"]  # fmt: skip
    assert headline(replace(result, fairness=runs))[-1] == (
        "light tenant's TTFT p99 with the heavy tenant over alone, tiered, 2 repetitions "
        "together: 1.67x (0.500 against 0.300 s); each 2.00x, 1.67x"
    )
    assert headline(replace(result, fairness=runs[:1]))[-1] == (
        "light tenant's TTFT p99 with the heavy tenant over alone, tiered: 2.00x (0.400 "
        "against 0.200 s)"
    )


def test_shed_answers_are_reported_per_load_with_the_gateways_own_part() -> None:
    def shed(request_id: str, e2e_s: float, server_s: float | None) -> RequestResult:
        return _result(request_id, "t", "standard", 1.0, 429, ttft_s=None, num_tokens=0,
                       num_requested=4, itl_s=[], e2e_s=e2e_s, error="overloaded",
                       server_s=server_s)  # fmt: skip

    def point(
        variant: str, factor: float, results: list[RequestResult],
        loop_lag: ClientLoopLag | None = None,
    ) -> LoadPoint:  # fmt: skip
        summary = summarize(variant, factor, results, TierTable())
        record = RunRecord(summary, results, client_loop_lag=loop_lag)
        return LoadPoint(variant, factor, 0, 0.0, None, record)

    served = _result("e", "t", "standard", 0.0, 200, ttft_s=0.1, num_tokens=1, num_requested=1,
                     itl_s=[], e2e_s=0.1)  # fmt: skip
    # The generator's loop: 22 ms late on waking at 1.02 s (held from 0.998 s, during b's
    # wait from 1.0 to 1.0344 s), 300 ms late at 5 s (after it), 5 ms late (not kept).
    loop_lag = ClientLoopLag()
    for at_s, late_s in ((1.02, 0.022), (5.0, 0.3), (1.01, 0.005)):
        loop_lag.observe(at_s, late_s)
    assert loop_lag.num_beats == 3 and len(loop_lag.late_beats) == 2
    assert loop_lag.most_late_within(0.9, 0.999) == 0.022  # held since 0.998 s
    assert loop_lag.most_late_within(1.03, 4.6) == 0.0
    # A stall of the generator's own loop during f's wait (1.0 to 1.0712 s), waiting for a
    # CPU most of it; and one after it, not f's.
    stalled = ClientLoopLag()
    for at_s, stall in (
        (1.06, LoopStall(0.061, loop_cpu_s=0.004, process_cpu_s=0.009, gc_s=0.0,
                         loop_waiting_s=0.052)),
        (7.0, LoopStall(0.2, loop_cpu_s=0.2, process_cpu_s=0.2, gc_s=0.2)),
    ):  # fmt: skip
        stalled.observe(at_s, stall.late_s)
        stalled.observe_stall(at_s, stall)
    caught = stalled.stall_within(1.0, 1.0712)
    assert caught is not None and caught.late_s == 0.061
    assert stalled.stall_within(2.0, 6.0) is None
    points = [
        point("tiered", 2.0, [shed("a", 0.0125, 0.002), shed("b", 0.0344, 0.004)], loop_lag),
        point("fcfs", 2.0, [served]),
        # a server without the header; the generator's loop never over 10 ms late
        point("tiered", 3.0, [shed("c", 0.0591, None)], ClientLoopLag(num_beats=6)),
        point("tiered-noshed", 3.0, [shed("d", 0.020, 0.001)]),
        point("tiered", 0.5, [served]),  # nothing shed: no entry
        point("tiered", 4.0, [shed("f", 0.0712, None)], stalled),
    ]
    calibration = Calibration(slo_scale=1.0, capacity_rps=1.0)
    machine = MachineInfo("cpu", 2, 24.0, "Linux", "3.11", "2.13.0", "now", 0.0)
    lines = headline(SweepResult(machine, calibration, TierTable(), 20.0, points))
    assert lines[-1] == ("shed requests answered: 2 at 2x, slowest 34.4 ms (4 in the gateway, "
                         "the generator's loop 22 late); 2 at 3x, slowest 59.1 ms "
                         "(the generator's loop under 10 late); 1 at 4x, slowest 71.2 ms "
                         "(the generator's loop 61 late, the stall: its thread on CPU 4 ms, "
                         "waiting for a CPU 52 ms, the process 9 ms, "
                         "garbage collection 0 ms)")  # fmt: skip


def test_the_engine_row_gives_the_collections_and_the_late_heartbeats() -> None:
    served = _result("e", "t", "standard", 0.0, 200, ttft_s=0.1, num_tokens=2, num_requested=2,
                     itl_s=[0.1], e2e_s=1.0)  # fmt: skip
    summary = summarize("tiered @ 2x", 2.0, [served], TierTable())

    def engine_row(activity: EngineActivity) -> str:
        return format_run(RunRecord(summary, [served], engine=activity)).splitlines()[-1]

    row = engine_row(EngineActivity(10, 0.5, 100, 50, 1, 20, 2, 2, 0.07, 3))
    # steps, step ms, busy%, prompt/step, new/step, preempted, recomputed, lane, full gc, gc ms,
    # heartbeats more than 50 ms late
    assert row.split()[-11:] == [
        "10", "50.0", "50.0", "10.0", "5.0", "1", "20", "2", "2", "35.0", "3"
    ]
    # no collection in the run: no mean to give
    assert engine_row(EngineActivity(10, 0.5, 100, 50, 1, 20, 2, 0, 0.0, 0)).split()[-3:] == [
        "0", "-", "0"
    ]


def test_host_steal_is_the_share_of_cpu_time_taken_by_the_hypervisor() -> None:
    earlier = CpuTicks(total=1000, steal=40)
    assert CpuTicks(total=1200, steal=70).steal_share_since(earlier) == pytest.approx(0.15)
    assert CpuTicks(total=1000, steal=40).steal_share_since(earlier) is None  # no time passed
    now = read_cpu_ticks()  # this machine is Linux: /proc/stat is there
    assert now is not None and 0 <= now.steal <= now.total


def test_engine_activity_is_read_from_the_metrics_exposition() -> None:
    engine = preempting_engine()
    metrics = GatewayMetrics(DEFAULT_TIERS)

    def scraped() -> EngineActivity | None:
        metrics.update_engine("m", engine.stats(), {})
        return engine_activity_of(generate_latest(metrics.registry).decode())

    before = scraped()
    assert before is not None
    assert dataclasses.astuple(before)[:7] == (0, 0.0, 0, 0, 0, 0, 0)
    while engine.has_unfinished_requests():
        engine.step()
    gc.collect()  # one full collection at least, counted by the process's recorder
    after = scraped()
    assert after is not None
    counters = engine.stats().counters
    run = after.minus(before)
    assert dataclasses.astuple(run)[:7] == (
        counters.num_steps, pytest.approx(counters.busy_time_s), counters.num_prompt_tokens,
        counters.num_generated_tokens, counters.num_preemptions, counters.num_recomputed_tokens,
        0,
    )
    assert run.num_full_gcs >= 1 and run.full_gc_s > 0
    assert run.num_late_beats == 0
    for late_s in (0.05, 0.0501, 0.3):  # 50 ms is on time (the bucket edge), the others late
        metrics.observe_loop_lag(late_s)
    late = scraped()
    assert late is not None and late.minus(after).num_late_beats == 2
    assert run.mean_full_gc_s == run.full_gc_s / run.num_full_gcs
    assert counters.num_preemptions >= 1 and counters.num_recomputed_tokens >= 1
    assert (after.num_prompt_tokens, after.num_generated_tokens) == (16, 16)  # 2 x 8 each
    assert after.mean_step_s == pytest.approx(counters.busy_time_s / counters.num_steps)
    assert after.mean_generated_per_step == 16 / counters.num_steps
    # A server without the engine's counters (an older one, say): nothing, not zeros.
    assert engine_activity_of("# HELP up Up.\n# TYPE up gauge\nup 1\n") is None


def test_capacity_is_counted_while_every_closed_loop_slot_is_busy() -> None:
    # Two in flight, stopped at the fourth completion: each request ends 1 s after it was
    # sent with tokens at +0.5/0.75/1.0 s; the two in flight at the end were cancelled.
    results = [
        _result(f"c{i}", "t", "premium", float(i), 200, ttft_s=0.5, num_tokens=3,
                num_requested=3, itl_s=[0.25, 0.25], e2e_s=1.0)
        for i in range(4)
    ] + [
        _result("c4", "t", "premium", 3.0, 200, ttft_s=0.5, num_tokens=2, num_requested=3,
                itl_s=[0.25], e2e_s=1.0, error=CANCELLED),
        _result("c5", "t", "premium", 4.0, 0, ttft_s=None, num_tokens=0, num_requested=3,
                itl_s=[], e2e_s=0.0, error=CANCELLED),
    ]
    assert results[1].token_times_s == [1.5, 1.75, 2.0]
    record = RunRecord(summarize("capacity", 0.0, results, TierTable()), results)
    # From the first completion (1 s) to the last (4 s): the tokens in between, the cancelled
    # request's two included, over the 3 tokens every request asked for.
    requests_per_s, tokens_per_s, window_s = capacity_window(record)
    assert window_s == pytest.approx(3.0)
    assert tokens_per_s == pytest.approx(11 / 3)
    assert requests_per_s == pytest.approx(11 / 3 / 3)


# -- against real servers --------------------------------------------------------------------

# Objectives so tight that a standard request with any prefill ahead of it is shed; premium
# still gets in while its KV reservation has room.
_TIGHT_TIERS = TierTable().scaled(1e-3)


def _limits() -> EngineLimits:
    return EngineLimits(model_dir=None, demo_model_dir=shared_demo_model_dir(),
                        kv_cache_bytes=16 << 20)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BenchServer]:
    bench_server = BenchServer(VARIANTS["tiered"], _TIGHT_TIERS, _limits(),
                               tmp_path_factory.mktemp("bench-server")).start()
    yield bench_server
    assert bench_server.stop() == 0, bench_server.log_path.read_text()


@pytest.fixture(scope="module")
def vocabulary() -> PromptVocabulary:
    return PromptVocabulary.of_model(shared_demo_model_dir())


def test_a_run_against_a_real_server_records_consistent_timings(
    server: BenchServer, vocabulary: PromptVocabulary
) -> None:
    assert server.config_file()["admission"] == {"enable_shedding": True}
    tenants = [("p0", "premium"), ("p1", "premium")]
    target = BenchTarget.provision(server.base_url, server.admin_token, tenants, vocabulary,
                                   progress=False)
    assert target.model == "tiergate-demo"
    workload = Workload(seed=1, rate_rps=12.0, requests=[
        _request(i, f"p{i % 2}", 0.08 * i, prompt_len=40 + 16 * i, output_len=4 + i, prefix=32)
        for i in range(6)
    ])
    record = target.run(workload, "smoke", _TIGHT_TIERS)
    assert len(record.results) == 6
    for r in record.results:
        assert r.status_code == 200 and r.error is None, r
        assert r.is_completed and r.num_output_tokens == r.num_output_tokens_requested
        assert len(r.itl_s) == r.num_output_tokens - 1  # one chunk per token
        assert r.ttft_s is not None and 0 < r.ttft_s <= r.e2e_s
        assert r.ttft_s + sum(r.itl_s) <= r.e2e_s
        assert r.tpot_s is not None
        assert r.tpot_s * (r.num_output_tokens - 1) == pytest.approx(r.e2e_s - r.ttft_s)
        assert r.sent_s >= r.scheduled_s
    summary = record.summary
    overall = summary.overall
    assert summary.offered_rps == 12.0
    assert (overall.num_requests, overall.num_completed, overall.num_shed) == (6, 6, 0)
    for stats in (overall.ttft_s, overall.tpot_s, overall.itl_s, overall.e2e_s):
        assert stats.p50 <= stats.p90 <= stats.p99
    assert overall.ttft_s.p99 <= overall.e2e_s.p99
    assert overall.output_tokens_per_s == pytest.approx(
        sum(4 + i for i in range(6)) / summary.duration_s
    )
    assert overall.goodput_rps == pytest.approx(
        sum(meets_slo(r, _TIGHT_TIERS) for r in record.results) / summary.duration_s
    )
    assert [t.name for t in summary.tiers] == ["premium"]
    assert {t.name for t in summary.tenants} == {"p0", "p1"}
    # What the engine did meanwhile, from the server's /metrics: a step per output token of
    # the longest request at least, each step's time counted.
    engine = record.engine
    assert engine is not None and engine.num_steps >= 9 and engine.busy_s > 0
    assert engine.num_preemptions == engine.num_recomputed_tokens == 0
    assert engine.num_generated_tokens == sum(4 + i for i in range(6))
    assert 0 < engine.num_prompt_tokens <= sum(40 + 16 * i for i in range(6))  # less hits
    assert 0 < engine.mean_step_s < summary.duration_s
    assert "engine during the run" in format_run(record)
    # Read again as the last request was sent: the arrivals' part of the same counters (the
    # first prompts computed by then, the last ones' and the drain's steps after it).
    arriving = record.engine_while_arriving
    assert arriving is not None and 0 < arriving.num_steps < engine.num_steps
    assert 0 < arriving.num_prompt_tokens < engine.num_prompt_tokens
    assert arriving.num_generated_tokens < engine.num_generated_tokens
    assert 0 < arriving.busy_s < engine.busy_s
    assert record.host_steal_share is not None and 0 <= record.host_steal_share <= 1
    # The generator's own loop was timed throughout the run (a beat due every 10 ms).
    assert record.client_loop_lag is not None
    assert record.client_loop_lag.num_beats >= summary.duration_s / 0.02
    document = run_json(record)
    assert document["client_loop_lag"]["num_beats"] == record.client_loop_lag.num_beats
    assert document["engine"]["num_steps"] == engine.num_steps
    assert document["engine_while_arriving"]["num_steps"] == arriving.num_steps
    json.dumps(document, allow_nan=False)
    # Provisioning again (tenants exist): they are reset and get fresh keys that work.
    again = BenchTarget.provision(server.base_url, server.admin_token, tenants, vocabulary,
                                  progress=False)
    assert again.keys.keys() == target.keys.keys() and again.keys != target.keys
    assert again.run(Workload(1, 1.0, workload.requests[:1]), "again",
                     _TIGHT_TIERS).results[0].is_completed


def test_shed_requests_are_counted_as_shed(
    server: BenchServer, vocabulary: PromptVocabulary
) -> None:
    target = BenchTarget.provision(server.base_url, server.admin_token, [("s0", "standard")],
                                   vocabulary, progress=False)
    # The first request lets the engine measure its prefill rate. Of the burst after it, a
    # request with another's prompt still ahead waits (by the estimate) longer than the
    # 1.6 ms threshold, so it is shed.
    workload = Workload(seed=2, rate_rps=1.0, requests=[
        _request(i, "s0", t, prompt_len=512, output_len=4, tier="standard")
        for i, t in enumerate([0.0] + [1.5] * 5)
    ])
    record = target.run(workload, "shed", _TIGHT_TIERS)
    shed = [r for r in record.results if r.is_shed]
    assert shed, [(r.status_code, r.error) for r in record.results]
    for r in shed:
        assert r.ttft_s is None and r.num_output_tokens == 0 and r.itl_s == []
        assert r.error is not None and "overloaded" in r.error
        # the gateway's openai-processing-ms (whole milliseconds, rounded), within the time
        # the client waited
        assert r.server_s is not None and 0 <= r.server_s <= r.e2e_s + 0.0005
    standard = record.summary.tier("standard")
    assert standard.num_shed == len(shed)
    assert standard.shed_rate == len(shed) / 6
    assert standard.shed_response_s.num_samples == len(shed)
    assert standard.num_completed + standard.num_shed == 6


def test_calibration_measures_prefill_and_closed_loop_capacity(
    server: BenchServer, vocabulary: PromptVocabulary
) -> None:
    tenants = [("cal-0", "premium")]
    target = BenchTarget.provision(server.base_url, server.admin_token, tenants, vocabulary,
                                   progress=False)
    samples = measure_reference_prefill_s(target, "cal-0", "premium", _TIGHT_TIERS, 2)
    assert len(samples) == 2 and all(s > 0 for s in samples)
    workload = Workload(seed=6, rate_rps=1.0, requests=[
        _request(i, "cal-0", float(i), prompt_len=20 + i, output_len=3) for i in range(6)
    ])
    capacity = measure_capacity(target, workload, _TIGHT_TIERS, 2, 3)
    ids = [r.request_id for r in capacity.results]
    assert ids == [f"r{i}" for i in range(len(ids))] and len(ids) >= 4  # sent in order
    # Stopped at the third completion (one more may end before the cancellation lands).
    num_completed = sum(r.is_completed for r in capacity.results)
    assert 3 <= num_completed <= 4
    for r in capacity.results:
        assert r.is_completed or r.error == CANCELLED
        assert r.scheduled_s <= r.sent_s
        # closed loop: never more than two in flight
        assert sum(o.sent_s <= r.sent_s < o.finish_s for o in capacity.results) <= 2
    # A second attempt on the same server sends prompts of its own: the engine computes
    # every prompt token again (a prefix-cache hit would leave all but the last block's).
    computed_before = _computed_prompt_tokens(server)
    more_samples = measure_reference_prefill_s(target, "cal-0", "premium", _TIGHT_TIERS, 2,
                                               attempt=1)
    assert _computed_prompt_tokens(server) - computed_before == 3 * REFERENCE_PROMPT_LEN
    computed_before = _computed_prompt_tokens(server)
    again = measure_capacity(target, workload, _TIGHT_TIERS, 2, 3, attempt=1)
    assert _computed_prompt_tokens(server) - computed_before >= sum(
        r.num_prompt_tokens for r in again.results if r.is_completed
    )
    # The same attempt again would have hit the cache: what the checks above rule out.
    computed_before = _computed_prompt_tokens(server)
    measure_reference_prefill_s(target, "cal-0", "premium", _TIGHT_TIERS, 2, attempt=1)
    assert _computed_prompt_tokens(server) - computed_before < REFERENCE_PROMPT_LEN
    calibration = calibration_of(TierTable(), prefill_attempts_s=[samples, more_samples],
                                 capacity_runs=[capacity, again], concurrency=2)
    reference_s = min(sum(samples) / 2, sum(more_samples) / 2)  # of two medians the shorter
    assert calibration.reference_prefill_s == pytest.approx(reference_s)
    assert calibration.slo_scale == pytest.approx(10 * reference_s / 0.5)
    assert calibration.is_slo_scale_measured and calibration.is_capacity_measured
    attempts = [CapacityAttempt.of(capacity), CapacityAttempt.of(again)]
    assert calibration.capacity_attempts == attempts
    best = max(attempts, key=lambda a: a.output_tokens_per_s)  # of two attempts the faster
    assert calibration.capacity == best
    assert (best.capacity_rps, best.output_tokens_per_s, best.window_s) in (
        capacity_window(capacity), capacity_window(again)
    )
    assert calibration.capacity_rps == best.capacity_rps
    assert attempts[0].num_completions == num_completed
    assert attempts[0].steal_share == capacity.host_steal_share is not None
    assert calibration.capacity_concurrency == 2
    # A given value wins over a measurement of it.
    given = calibration_of(TierTable(), slo_scale_given=4.0, prefill_attempts_s=[samples],
                           capacity_rps_given=3.0, capacity_runs=[capacity])
    assert (given.slo_scale, given.capacity_rps) == (4.0, 3.0)
    assert not given.is_slo_scale_measured and not given.is_capacity_measured
    with pytest.raises(BenchConfigError):
        measure_capacity(target, workload, _TIGHT_TIERS, 2, 1)  # no window


def _computed_prompt_tokens(server: BenchServer) -> int:
    activity = read_engine_activity(server.base_url)
    assert activity is not None
    return activity.num_prompt_tokens


def _workload_file(path: Path, requests: list[WorkloadRequest], rate_rps: float) -> Path:
    rows = [
        {"id": r.request_id, "arrival_s": r.arrival_s, "tenant": r.tenant, "tier": r.tier,
         "prompt_len": r.prompt_len, "output_len": r.output_len,
         "shared_prefix_len": r.shared_prefix_len}
        for r in requests
    ]
    path.write_text(json.dumps({"seed": 5, "rate_rps": rate_rps, "requests": rows}))
    return path


def _bench(argv: list[str], capsys: pytest.CaptureFixture[str]) -> tuple[int, str, str]:
    code = cli.main(["bench", "serve", "--no-progress",
                     "--demo-model-dir", str(shared_demo_model_dir()), *argv])
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_command_line_one_run_against_url(
    server: BenchServer, tmp_path: Path, monkeypatch: pytest.MonkeyPatch,
    capsys: pytest.CaptureFixture[str],
) -> None:
    workload = _workload_file(tmp_path / "workload.json", [
        _request(i, "premium-0", 0.1 * i, prompt_len=32, output_len=3) for i in range(3)
    ], rate_rps=10.0)
    monkeypatch.setenv("TIERGATE_ADMIN_TOKEN", server.admin_token)
    code, out, err = _bench(["--url", server.base_url, "--workload", str(workload),
                             "--request-rate", "20", "--num-requests", "3", "--json",
                             "--plot", str(tmp_path / "plots")],
                            capsys)
    assert code == 0, err
    document = json.loads(out)
    assert [t["name"] for t in document["tiers"]] == ["premium", "standard", "batch"]
    summary = document["summary"]
    assert summary["offered_rps"] == 20.0
    assert summary["overall"]["num_requests"] == 3
    assert summary["overall"]["num_completed"] == 3
    # The file's arrivals scaled to 20 req/s over the three requests: the last at 3 / 20 s.
    assert [r["scheduled_s"] for r in document["requests"]] == pytest.approx([0.0, 0.075, 0.15])
    assert (tmp_path / "plots" / "ttft_cdf.png").stat().st_size > 0
    # Without the admin token the run cannot create its tenants: a clear error, exit 1.
    monkeypatch.delenv("TIERGATE_ADMIN_TOKEN")
    code, out, err = _bench(["--url", server.base_url, "--workload", str(workload)], capsys)
    assert code == 1 and "TIERGATE_ADMIN_TOKEN" in err


def _sweep_workload_file(path: Path) -> Path:
    """300 requests, one premium to two standard, 2 per second: the small sweeps' workload."""
    return _workload_file(path, [
        _request(i, f"{tier}-0", 0.5 * i, prompt_len=24 + i % 40, output_len=4, tier=tier)
        for i in range(300)
        for tier in ["premium" if i % 3 == 0 else "standard"]
    ], rate_rps=2.0)


def test_a_sweep_that_measures_the_capacity_before_every_turn(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """--capacity-each-turn: a fresh FCFS server measures the capacity before each load
    repetition, and that repetition's runs offer their load factor times it."""
    workload = _sweep_workload_file(tmp_path / "workload.json")
    output = tmp_path / "sweep.json"
    code, out, err = _bench([
        "--sweep", "--workload", str(workload), "--work-dir", str(tmp_path / "servers"),
        "--slo-scale", "3", "--capacity-each-turn", "--calibrations", "1",
        "--capacity-concurrency", "2", "--capacity-completions", "3", "--variants",
        "tiered,fcfs", "--loads", "2", "--duration", "2", "--fairness-variants", "",
        "--kv-cache-bytes", str(16 << 20), "--repeats", "2", "--output", str(output),
    ], capsys)
    assert code == 0, err
    document = json.loads(output.read_text())
    servers = ["calibration", "capacity-2x-1", "tiered-2x-1", "fcfs-2x-1", "capacity-2x-2",
               "fcfs-2x-2", "tiered-2x-2"]
    assert list(document["server_exit_codes"]) == servers
    assert set(document["server_exit_codes"].values()) == {0}
    runs = document["runs"]
    turns = {r["repeat"]: r["turn_capacity"] for r in runs}
    assert len(turns) == 2 and all(t["num_completions"] >= 3 for t in turns.values())
    for run in runs:
        turn = turns[run["repeat"]]
        assert run["turn_capacity"] == turn and run["capacity_rps"] == turn["capacity_rps"]
        assert run["summary"]["offered_rps"] == pytest.approx(2 * turn["capacity_rps"])
    assert document["calibration"]["is_capacity_measured"] is True  # the calibration's too
    assert "capacity measured again before each turn" in out
    for repeat, turn in turns.items():
        assert f"2x #{repeat + 1} {turn['capacity_rps']:.3f}" in out
        assert f"capacity-2x-{repeat + 1}: {turn['capacity_rps']:.3f} req/s" in err
    assert "against its turn's capacity run" in out
    # A capacity measured every turn and a given one contradict each other.
    code, _, err = _bench(["--sweep", "--workload", str(workload), "--capacity", "4",
                           "--capacity-each-turn"], capsys)
    assert code != 0 and "cannot also be given" in err


def test_a_small_sweep_from_the_command_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    workload = _sweep_workload_file(tmp_path / "workload.json")
    output = tmp_path / "sweep.json"
    # Scale and capacity given (as when repeating a sweep): no calibration server; the
    # measurements themselves are tested above against the module's server.
    code, out, err = _bench([
        "--sweep", "--workload", str(workload), "--work-dir", str(tmp_path / "servers"),
        "--slo-scale", "3", "--capacity", "4", "--variants", "fcfs", "--loads", "0.5",
        "--duration", "2", "--fairness-variants", "fcfs", "--fairness-load", "1",
        "--fairness-duration", "2",
        "--heavy-ratio", "2", "--kv-cache-bytes", str(16 << 20), "--repeats", "2",
        "--output", str(output), "--plot", str(tmp_path / "plots"),
    ], capsys)
    assert code == 0, err
    assert "SLO scale 3.00" in err  # progress goes to stderr
    assert "SLO scale 3.00 (given)" in out and "fcfs @ 0.5x" in out and "fairness" in out
    assert "arrivals per load run: 2.0 s" in out
    document = json.loads(output.read_text())
    assert document["duration_s"] == 2.0
    # A fresh server for every run: each load repetition, each fairness repetition.
    runs_by_server = ["fcfs-0.5x-1", "fcfs-0.5x-2", "fcfs-fairness-1", "fcfs-fairness-2"]
    assert document["server_exit_codes"] == dict.fromkeys(runs_by_server, 0)
    assert sorted(p.name for p in (tmp_path / "servers").iterdir()) == runs_by_server
    calibration = document["calibration"]
    assert calibration["is_slo_scale_measured"] is False
    assert calibration["is_capacity_measured"] is False
    premium = next(t for t in document["tiers"] if t["name"] == "premium")
    assert premium["ttft_slo_s"] == pytest.approx(0.5 * 3)
    assert document["repeats"] == 2
    runs = document["runs"]
    assert [(r["variant"], r["load_factor"], r["repeat"]) for r in runs] == [
        ("fcfs", 0.5, 0), ("fcfs", 0.5, 1)
    ]
    assert "fcfs @ 0.5x #1" in out and "fcfs @ 0.5x #2" in out
    assert "at 0.5x" not in out  # no tiered run to compare with
    for run in runs:
        assert run["summary"]["offered_rps"] == pytest.approx(2.0)
        assert len(run["requests"]) == 4  # 2 req/s over 2 s
        overall = run["summary"]["overall"]
        assert overall["num_completed"] == overall["num_requests"] == len(run["requests"])
        assert run["engine"]["num_steps"] >= 4 and "engine during the run" in out
        assert 0 <= run["host_steal_share"] <= 1 and "steal%" in out
    # The second repetition's prompts are its own: every prompt token computed again.
    computed = [r["engine"]["num_prompt_tokens"] for r in runs]
    assert computed[0] == computed[1] == sum(r["num_prompt_tokens"] for r in runs[0]["requests"])
    assert [(f["variant"], f["repeat"]) for f in document["fairness"]] == [("fcfs", 0), ("fcfs", 1)]
    assert "fcfs, all 2" in out
    assert "engine while arriving" in out
    for run in runs:
        arriving, engine = run["engine_while_arriving"], run["engine"]
        assert 0 < arriving["num_steps"] < engine["num_steps"]
    for fairness in document["fairness"]:
        assert fairness["heavy_rate_rps"] == pytest.approx(2 * fairness["light_rate_rps"])
        alone = fairness["alone"]["summary"]["tenants"]
        shared = {t["name"]: t for t in fairness["shared"]["summary"]["tenants"]}
        assert [t["name"] for t in alone] == ["light"] and set(shared) == {"heavy", "light"}
        assert alone[0]["num_requests"] == shared["light"]["num_requests"]
        assert fairness["light_ttft_p99_ratio"] == pytest.approx(
            shared["light"]["ttft_s"]["p99"] / alone[0]["ttft_s"]["p99"]
        )
    assert sorted(p.name for p in (tmp_path / "plots").iterdir()) == [
        "slo_attainment.png", "throughput.png", "ttft_cdf.png"
    ]


def test_a_servers_cpu_time_counts_the_processes_it_started() -> None:
    """The server's engine runs in a child process: its CPU time is the server's too."""
    spin = (
        "import time\n"
        "while time.process_time() < 0.3: pass\n"
        "print('spent', flush=True)\n"
        "time.sleep(60)\n"
    )
    parent = subprocess.Popen(
        ["bash", "-c", f'{sys.executable} -c "{spin}"; sleep 60'],
        stdout=subprocess.PIPE,
        start_new_session=True,  # its own group: the kill below takes the child too
    )
    try:
        assert parent.stdout is not None and parent.stdout.readline() == b"spent\n"
        tree_cpu_s = process_tree_cpu_s(parent.pid)
        own = Path(f"/proc/{parent.pid}/stat").read_text().rsplit(")", 1)[1].split()
        own_cpu_s = (int(own[11]) + int(own[12])) / os.sysconf("SC_CLK_TCK")
    finally:
        os.killpg(parent.pid, signal.SIGKILL)
        parent.wait()
        if parent.stdout is not None:
            parent.stdout.close()
    assert tree_cpu_s is not None and tree_cpu_s >= own_cpu_s + 0.29  # clock ticks round down
    assert process_tree_cpu_s(parent.pid) is None  # gone
