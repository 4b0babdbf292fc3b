"""Measuring the machine before a sweep: the SLO scale and the capacity.

SLO scale, as `bench.simulation.premium_slo_scale` does on the simulated machine: premium's
GPU TTFT objective (500 ms) is taken as 10x an unloaded 1024-token prefill on a GPU, and keeps
that ratio here, so every objective of the tier table is multiplied by
10 x (this server's unloaded 1024-token TTFT) / 500 ms. The unloaded TTFT is the median over a
few lone requests (1024 prompt tokens, 1 output token) sent one after another after a
warm-up, timed by the client like every other TTFT of the report.

Capacity: the workload's first C + K requests sent closed-loop with C in flight (C: the
engine's max_num_seqs by default, a full batch; FCFS server, nothing shed), counted over
the window in which every slot stayed busy: from the first completion to the K-th, when
the last request has been sent; the run stops there and cancels the requests still in
flight (the batch would only drain from then on). Output tokens per second in that window,
over the mean output length of the requests sent, is the request rate the server sustains
on this mix with a full batch: beyond it the queue grows without bound. (Counting the
completions instead would overstate it: the first requests to complete are the shortest.)

Both are measured in several attempts, one after another on the same server (each with
its own prompts, so none is a prefix-cache hit), and the middle attempt of each kept: the
median of the attempts' median prefills and the capacity attempt with the median output
tokens/s (of an even number of attempts, the faster of the middle two). Until 2026-11-26 the
fastest attempt of each was kept, for hosts whose other guests take CPU time in bursts
(steal 0-17 % of a run): a calibration taken in a burst makes every load lighter than its
label. On the hosts since (no steal, but a speed that drifts both ways by 10-30 % within a
quarter of an hour) the fastest of three was an outlier at times: run 54 kept an attempt of
2,806 output tokens/s against the other two's 2,483 and 2,432, and its "2x" offered 2.6-3.3x
of what FCFS sustained in its later repetitions (ops/bench/journal.md). The middle attempt
is the host's usual speed whether the outlier is a burst of steal or a fast moment, as long
as it is one attempt of three.
"""

from __future__ import annotations

import statistics
from dataclasses import dataclass, field, replace

from bench.serve.errors import BenchConfigError, BenchServeError
from bench.serve.loadgen import CANCELLED
from bench.serve.session import BenchTarget, RunRecord
from bench.workload import Workload, WorkloadRequest
from policies import TierTable

__all__ = [
    "REFERENCE_PROMPT_LEN",
    "Calibration",
    "CapacityAttempt",
    "calibration_of",
    "capacity_window",
    "measure_capacity",
    "measure_reference_prefill_s",
    "slo_scale",
]

REFERENCE_PROMPT_LEN = 1024  # tokens of the unloaded reference prefill
# The premium TTFT objective is this many unloaded reference prefills (bench.simulation).
_PREFILLS_PER_PREMIUM_SLO = 10
# Seeds of the probes' prompts start here, far from any workload's seed: every attempt's
# probes and capacity run get prompts of their own.
_PROBE_SEED_BASE = 1_000_000


@dataclass(frozen=True)
class CapacityAttempt:
    """One closed-loop capacity run, reduced to its window (see capacity_window)."""

    capacity_rps: float
    output_tokens_per_s: float
    window_s: float
    num_completions: int  # completions the window spans
    steal_share: float | None  # CPU time the hypervisor took during the run (None: unknown)

    @classmethod
    def of(cls, record: RunRecord) -> CapacityAttempt:
        capacity_rps, tokens_per_s, window_s = capacity_window(record)
        num_completions = sum(r.is_completed for r in record.results)
        return cls(capacity_rps, tokens_per_s, window_s, num_completions,
                   record.host_steal_share)


@dataclass(frozen=True)
class Calibration:
    """The SLO scale and the capacity a sweep runs with: measured first, or given (to repeat
    an earlier sweep at the same offered loads and objectives)."""

    slo_scale: float  # factor applied to every latency objective of the tier table
    capacity_rps: float  # requests/s the loads are multiples of
    # Each attempt's probe TTFTs (warm-up excluded); empty when the scale was given.
    prefill_attempts_s: list[list[float]] = field(default_factory=list)
    # Each attempt's closed-loop run; empty when the capacity was given.
    capacity_attempts: list[CapacityAttempt] = field(default_factory=list)
    capacity_concurrency: int = 0  # requests the closed-loop runs kept in flight

    @property
    def reference_prefill_s(self) -> float | None:
        """The middle of the attempts' median unloaded 1024-token TTFTs (None: scale given)."""
        medians = sorted(statistics.median(s) for s in self.prefill_attempts_s if s)
        return medians[_middle(len(medians))] if medians else None

    @property
    def capacity(self) -> CapacityAttempt | None:
        """The attempt the capacity comes from: the middle one by output tokens/s (None:
        given)."""
        if not self.capacity_attempts:
            return None
        fastest_first = sorted(self.capacity_attempts, key=lambda a: -a.output_tokens_per_s)
        return fastest_first[_middle(len(fastest_first))]

    @property
    def is_slo_scale_measured(self) -> bool:
        return self.reference_prefill_s is not None

    @property
    def is_capacity_measured(self) -> bool:
        return self.capacity is not None


def _middle(num_attempts: int) -> int:
    """Index of the attempt kept among num_attempts sorted fastest first: the middle one, of
    two middle ones the faster (the tighter objectives and the heavier loads)."""
    return (num_attempts - 1) // 2


def slo_scale(reference_prefill_s: float, tiers: TierTable) -> float:
    """The factor that maps GPU objectives to this machine (see the module docstring)."""
    gpu_slo_s = tiers["premium"].ttft_slo_s
    if gpu_slo_s is None:
        raise BenchServeError("the premium tier has no TTFT objective to scale from")
    return _PREFILLS_PER_PREMIUM_SLO * reference_prefill_s / gpu_slo_s


def measure_reference_prefill_s(
    target: BenchTarget,
    tenant: str,
    tier: str,
    tiers: TierTable,
    num_probes: int = 5,
    *,
    attempt: int = 0,
) -> list[float]:
    """Unloaded TTFT of each probe (a 1024-token prompt), one request at a time; each
    attempt on a server sends prompts of its own."""
    samples = []
    for index in range(num_probes + 1):  # the first is a warm-up
        probe = WorkloadRequest(
            request_id=f"prefill-{index}",
            arrival_s=0.0,
            tenant=tenant,
            tier=tier,
            prompt_len=REFERENCE_PROMPT_LEN,
            output_len=1,
            shared_prefix_len=0,
        )
        seed = _PROBE_SEED_BASE + attempt * (num_probes + 1) + index
        record = target.run(Workload(seed=seed, rate_rps=0.0, requests=[probe]), "", tiers, 0.0)
        result = record.results[0]
        if result.ttft_s is None:
            raise BenchServeError(f"the reference prefill failed: {result.error}")
        if index:
            samples.append(result.ttft_s)
    return samples


def measure_capacity(
    target: BenchTarget,
    workload: Workload,
    tiers: TierTable,
    concurrency: int,
    num_completions: int,
    *,
    attempt: int = 0,
) -> RunRecord:
    """The closed-loop run behind the capacity figures: the workload's first
    concurrency + num_completions requests, stopped at the num_completions-th completion
    (the end of the window, see capacity_window), the requests in flight then cancelled.
    Each attempt on a server has prompts of its own (prompt seed: the workload's + attempt)."""
    if num_completions < 2:
        raise BenchConfigError("the capacity run needs at least 2 completions")
    requests = replace(workload, requests=workload.requests[: concurrency + num_completions],
                       seed=workload.seed + attempt)
    record = target.run_closed_loop(requests, concurrency, "capacity (closed loop)", tiers,
                                    num_to_complete=num_completions)
    refused = [r for r in record.results if not r.is_completed and r.error != CANCELLED]
    if refused:
        raise BenchServeError(
            f"capacity run: {len(refused)} request(s) not completed, e.g. {refused[0].error} "
            "(the calibration server must not shed)"
        )
    return record


def capacity_window(record: RunRecord) -> tuple[float, float, float]:
    """(requests/s, output tokens/s, window seconds) of a closed-loop run stopped at its
    K-th completion, over the window from its first completion to the K-th, while every slot
    was busy (tokens of the requests cancelled at the end count too).

    Requests/s is the token rate over the mean output length of the requests sent: the
    completions themselves would overstate it, as the first to complete are the shortest.
    """
    finishes = sorted(r.finish_s for r in record.results if r.is_completed)
    start_s, end_s = finishes[0], finishes[-1]
    window_s = end_s - start_s
    num_tokens = sum(start_s < t <= end_s for r in record.results for t in r.token_times_s)
    tokens_per_s = num_tokens / window_s
    mean_output_len = statistics.fmean(r.num_output_tokens_requested for r in record.results)
    return tokens_per_s / mean_output_len, tokens_per_s, window_s


def calibration_of(
    tiers: TierTable,
    *,
    slo_scale_given: float | None = None,
    prefill_attempts_s: list[list[float]] | None = None,
    capacity_rps_given: float | None = None,
    capacity_runs: list[RunRecord] | None = None,
    concurrency: int = 0,
) -> Calibration:
    """The calibration from a given value or the attempts at measuring each figure (a
    given value wins over measurements of it)."""
    prefills = [] if slo_scale_given is not None else [list(s) for s in prefill_attempts_s or []]
    runs = [] if capacity_rps_given is not None else capacity_runs or []
    attempts = [CapacityAttempt.of(record) for record in runs]
    calibration = Calibration(0.0, 0.0, prefills, attempts, concurrency if attempts else 0)
    reference_s, kept = calibration.reference_prefill_s, calibration.capacity
    if slo_scale_given is None and reference_s is None:
        raise BenchConfigError("neither an SLO scale nor prefill samples")
    if capacity_rps_given is None and kept is None:
        raise BenchConfigError("neither a capacity nor a capacity run")
    scale = slo_scale(reference_s, tiers) if reference_s is not None else slo_scale_given
    capacity_rps = kept.capacity_rps if kept is not None else capacity_rps_given
    assert scale is not None and capacity_rps is not None
    return replace(calibration, slo_scale=scale, capacity_rps=capacity_rps)
