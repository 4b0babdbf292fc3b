"""From per-request results to the figures of the report: latency percentiles, SLO
attainment, goodput, shed rate and output tokens/s, per tier, per tenant and overall.

Definitions (every rate over the run's duration: first send to last response end, except
the one named "while arrivals last"):
- TTFT and TPOT percentiles over requests that got tokens; TPOT is (e2e - TTFT) / (n - 1);
  inter-token gaps (ITL) pooled over requests; end-to-end over completed requests.
- A request meets its SLOs when it completed with every requested token, its TTFT is within
  the tier's TTFT objective and its TPOT within the TPOT objective (a missing objective is
  met). Shed and failed requests count as misses: attainment is over requests sent.
- Goodput: requests meeting both SLOs per second. Shed rate: 429s over requests sent.
- Output tokens/s while arrivals last: tokens received between the first and the last send,
  over that time. A run ends when its last response does, so the whole-run rate also counts
  the drain after the arrivals stop: a server that accepted a backlog (FCFS at 2x) decodes
  it at a full batch for as long again, one that shed it tails off within seconds. The
  machine's throughput under the offered load is the rate while it is offered.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from bench.serve.loadgen import RequestResult
from bench.stats import Percentiles
from policies import TierTable

__all__ = [
    "GroupSummary",
    "RunSummary",
    "meets_slo",
    "share_of_requests",
    "summarize",
    "time_weighted",
]


@dataclass(frozen=True)
class GroupSummary:
    """The figures of one group of requests: a tier, a tenant, or all of them."""

    name: str  # tier name, tenant name, or "all"
    num_requests: int  # sent
    num_completed: int  # streamed to the end with every requested token
    num_shed: int  # answered 429
    num_failed: int  # neither completed nor shed
    ttft_s: Percentiles
    tpot_s: Percentiles
    itl_s: Percentiles  # every gap between two tokens of a request
    e2e_s: Percentiles
    shed_response_s: Percentiles  # how long a 429 took to come back
    ttft_slo_attainment: float  # share of requests sent whose TTFT met the objective
    slo_attainment: float  # share of requests sent that met both objectives
    goodput_rps: float  # requests meeting both objectives per second
    shed_rate: float  # num_shed / num_requests
    output_tokens_per_s: float  # tokens received (completed or not) per second


@dataclass(frozen=True)
class RunSummary:
    """One run: one server configuration at one offered load."""

    label: str  # e.g. "tiered @ 2.0x"
    offered_rps: float  # the planned arrival rate
    duration_s: float  # first send to the last response's end
    max_send_lag_s: float  # worst lateness of a send against its plan (generator health)
    arrival_window_s: float  # first send to last send
    output_tokens_per_s_while_arriving: float  # all requests' tokens in that window, per second
    overall: GroupSummary
    tiers: list[GroupSummary]  # one per tier present, by name
    tenants: list[GroupSummary]  # one per tenant present, by name

    def tier(self, name: str) -> GroupSummary:
        for group in self.tiers:
            if group.name == name:
                return group
        raise KeyError(f"no request of tier {name!r} in run {self.label!r}")

    def tenant(self, name: str) -> GroupSummary:
        for group in self.tenants:
            if group.name == name:
                return group
        raise KeyError(f"no request of tenant {name!r} in run {self.label!r}")


def meets_ttft_slo(result: RequestResult, tiers: TierTable) -> bool:
    objective = tiers[result.tier].ttft_slo_s
    return result.ttft_s is not None and (objective is None or result.ttft_s <= objective)


def meets_slo(result: RequestResult, tiers: TierTable) -> bool:
    """Completed, TTFT and TPOT within the tier's objectives."""
    if not result.is_completed or not meets_ttft_slo(result, tiers):
        return False
    objective = tiers[result.tier].tpot_slo_s
    tpot = result.tpot_s
    return objective is None or tpot is None or tpot <= objective


def summarize(
    label: str, offered_rps: float, results: Sequence[RequestResult], tiers: TierTable
) -> RunSummary:
    if not results:
        raise ValueError("no results to summarize")
    start_s = min(r.sent_s for r in results)
    last_send_s = max(r.sent_s for r in results)
    duration_s = max(r.finish_s for r in results) - start_s
    window_s = last_send_s - start_s
    num_tokens_in_window = sum(
        start_s <= t <= last_send_s for r in results for t in r.token_times_s
    )
    return RunSummary(
        label=label,
        offered_rps=offered_rps,
        duration_s=duration_s,
        max_send_lag_s=max(r.sent_s - r.scheduled_s for r in results),
        arrival_window_s=window_s,
        output_tokens_per_s_while_arriving=(
            num_tokens_in_window / window_s if window_s > 0 else math.nan
        ),
        overall=_group("all", results, tiers, duration_s),
        tiers=_groups(results, lambda r: r.tier, tiers, duration_s),
        tenants=_groups(results, lambda r: r.tenant, tiers, duration_s),
    )


def _groups(
    results: Sequence[RequestResult],
    key: Callable[[RequestResult], str],
    tiers: TierTable,
    duration_s: float,
) -> list[GroupSummary]:
    names = sorted({key(r) for r in results})
    return [
        _group(name, [r for r in results if key(r) == name], tiers, duration_s) for name in names
    ]


def _group(
    name: str, results: Sequence[RequestResult], tiers: TierTable, duration_s: float
) -> GroupSummary:
    num = len(results)
    completed = [r for r in results if r.is_completed]
    shed = [r for r in results if r.is_shed]
    num_good = sum(meets_slo(r, tiers) for r in results)
    per_s = 1 / duration_s if duration_s > 0 else math.nan
    return GroupSummary(
        name=name,
        num_requests=num,
        num_completed=len(completed),
        num_shed=len(shed),
        num_failed=num - len(completed) - len(shed),
        ttft_s=Percentiles.of([r.ttft_s for r in results if r.ttft_s is not None]),
        tpot_s=Percentiles.of([t for r in results if (t := r.tpot_s) is not None]),
        itl_s=Percentiles.of([gap for r in results for gap in r.itl_s]),
        e2e_s=Percentiles.of([r.e2e_s for r in completed]),
        shed_response_s=Percentiles.of([r.e2e_s for r in shed]),
        ttft_slo_attainment=sum(meets_ttft_slo(r, tiers) for r in results) / num,
        slo_attainment=num_good / num,
        goodput_rps=num_good * per_s,
        shed_rate=len(shed) / num,
        output_tokens_per_s=sum(r.num_output_tokens for r in results) * per_s,
    )


def share_of_requests(
    groups: Sequence[GroupSummary], share: Callable[[GroupSummary], float]
) -> float:
    """A share (of requests sent) over several runs' groups together: each group weighted by
    its requests; NaN without any."""
    num = sum(g.num_requests for g in groups)
    return sum(share(g) * g.num_requests for g in groups) / num if num else math.nan


def time_weighted(rates: Sequence[tuple[float, float]]) -> float:
    """A rate over several runs together from (rate, seconds) pairs: everything counted
    over all the time; NaN without any time."""
    total_s = sum(seconds for _, seconds in rates)
    return sum(rate * seconds for rate, seconds in rates) / total_s if total_s else math.nan
