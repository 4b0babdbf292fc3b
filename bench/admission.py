"""`tiergate bench admission`: how long admission's decisions take, in microseconds.

A seeded mix of --decisions requests from 100 tenants over the default tiers and a busy
engine (some shed, some refused by their limits, the rest admitted and never released),
each decision timed on its own: the budget check, the SLO shed decision, the in-memory rate
limits, and whole AdmissionController.admit() calls on the memory limiter (policies.admission).

Never a CI gate: the figures depend on the machine. `--json` prints the rows as JSON.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import random
import statistics
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass

from engine import SchedulerStats, TierStats
from policies import (
    AdmissionController,
    AdmissionRefused,
    AdmissionRequest,
    MemoryRateLimiter,
    MonthlyUsage,
    SloShedder,
    TenantLimits,
    TenantShare,
    TierTable,
    check_budgets,
)

__all__ = [
    "LatencyRow",
    "add_arguments",
    "format_latency_table",
    "measure_decision_latency",
    "report",
]


@dataclass(frozen=True)
class LatencyRow:
    name: str  # what was timed
    num_decisions: int
    mean_us: float
    p50_us: float
    p99_us: float


class _FixedUsage:
    """MonthlyUsageSource answering from a dict, as the ledger's running totals would."""

    def __init__(self, totals: dict[str, MonthlyUsage]) -> None:
        self._totals = totals

    async def monthly_usage(self, tenant_id: str) -> MonthlyUsage:
        return self._totals[tenant_id]

    async def key_monthly_usage(self, api_key_id: str) -> MonthlyUsage:
        return MonthlyUsage(0, 0)  # the bench's requests carry no key limits


def measure_decision_latency(num_decisions: int = 20_000, seed: int = 0) -> list[LatencyRow]:
    """Time each admission check, and whole admit() calls on the memory limiter.

    A seeded mix of 100 tenants over the default tiers and a busy engine: some requests are
    shed, some refused by their limits, the rest admitted (and never released).
    """
    rng = random.Random(seed)
    tiers = TierTable()
    tenants = [f"t{i}" for i in range(100)]
    totals = {t: MonthlyUsage(rng.randrange(10**6), rng.randrange(10**9)) for t in tenants}
    stats = SchedulerStats(
        tiers={
            0: TierStats(0, "premium", 8, 2, 2_000, 300, 300),
            1: TierStats(1, "standard", 40, 60, 30_000, 600, 0),
            2: TierStats(2, "batch", 10, 200, 90_000, 100, 0),
        },
        num_kv_blocks_total=1_000,
        num_kv_blocks_used=1_000,
        prefill_tokens_per_s=20_000.0,
    )
    limits = TenantLimits(600, 200_000, None, None, 64, 10**6, 10**9)
    requests = [
        AdmissionRequest(
            rng.choice(tenants),
            rng.choice(tiers.names),
            limits,
            rng.randrange(10, 2_000),
            rng.randrange(1, 512),
        )
        for _ in range(num_decisions)
    ]
    shedder = SloShedder(tiers)
    limiter = MemoryRateLimiter()
    controller = AdmissionController(MemoryRateLimiter(), tiers, _FixedUsage(totals),
                                     lambda _model: stats)

    def timed(name: str, decide: Callable[[AdmissionRequest], object]) -> LatencyRow:
        samples_ns = []
        for request in requests:
            start_ns = time.perf_counter_ns()
            with contextlib.suppress(AdmissionRefused):
                decide(request)
            samples_ns.append(time.perf_counter_ns() - start_ns)
        return _latency_row(name, samples_ns)

    async def timed_admit() -> LatencyRow:
        samples_ns = []
        for request in requests:
            start_ns = time.perf_counter_ns()
            with contextlib.suppress(AdmissionRefused):
                await controller.admit(request)
            samples_ns.append(time.perf_counter_ns() - start_ns)
        return _latency_row("admit (memory limiter, all checks)", samples_ns)

    return [
        timed(
            "budget check",
            lambda r: check_budgets(r.tenant_id, r.limits, totals[r.tenant_id]),
        ),
        timed(
            "SLO shed decision",
            lambda r: shedder.check(
                stats, r.tier, r.num_prompt_tokens, TenantShare(r.tenant_id, r.weight)
            ),
        ),
        timed(
            "rate limits (memory)",
            lambda r: limiter.acquire_now(r.tenant_id, r.limits, r.num_tokens_reserved),
        ),
        asyncio.run(timed_admit()),
    ]


def _latency_row(name: str, samples_ns: list[int]) -> LatencyRow:
    samples_us = [ns / 1000 for ns in samples_ns]
    quantiles = statistics.quantiles(samples_us, n=100)
    return LatencyRow(
        name, len(samples_us), statistics.fmean(samples_us), quantiles[49], quantiles[98]
    )


def format_latency_table(rows: list[LatencyRow]) -> str:
    lines = [f"{'decision':<38} {'n':>7} {'mean us':>9} {'p50 us':>9} {'p99 us':>9}"]
    lines += [
        f"{r.name:<38} {r.num_decisions:>7} {r.mean_us:>9.2f} {r.p50_us:>9.2f} {r.p99_us:>9.2f}"
        for r in rows
    ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--decisions", type=int, default=20_000,
                        help="requests decided per row (default: 20000)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the requests' mix")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def report(args: argparse.Namespace) -> int:
    rows = measure_decision_latency(args.decisions, args.seed)
    if args.json:
        print(json.dumps({"rows": [asdict(r) for r in rows], "seed": args.seed}, indent=2))
    else:
        print(format_latency_table(rows))
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return report(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
