"""Scheduling on a simulated machine: the FakeModelRunner's cost model drives a virtual clock.

Used by tests and `python -m bench.simulation` to compare the tiered policy with FCFS on the
same workload; no model, no sleeping, deterministic.
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from bench.stats import percentile
from bench.workload import Workload
from engine.config import CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig
from engine.core.fcfs_policy import FCFSPolicy
from engine.core.llm_engine import LLMEngine
from engine.core.scheduling_policy import SchedulingPolicy
from engine.sampling_params import SamplingParams
from engine.testing.clock import SimulatedClock
from engine.testing.fake_runner import CostModel, FakeModelRunner
from engine.types import TenantContext


@dataclass
class SimulatedMachine:
    """Engine settings and cost model of the machine being simulated."""

    num_kv_blocks: int = 1024
    block_size: int = 16
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64
    vocab_size: int = 32000
    cost_model: CostModel = field(default_factory=CostModel)

    def unloaded_ttft_s(self, num_prompt_tokens: int) -> float:
        """TTFT of a lone request: its prompt in budget-sized chunks."""
        total = 0.0
        for start in range(0, num_prompt_tokens, self.max_num_batched_tokens):
            n = min(self.max_num_batched_tokens, num_prompt_tokens - start)
            total += self.cost_model.step_time_s(n, n * (2 * start + n + 1) // 2)
        return total


@dataclass
class Policy:
    """How the simulated engine orders and protects tiers."""

    name: str
    make_policy: Callable[[], SchedulingPolicy]
    reserved_fractions: dict[int, float]  # priority -> KV share


def fcfs_policy() -> Policy:
    return Policy("fcfs", FCFSPolicy, {})


@dataclass
class RequestRecord:
    request_id: str
    tenant: str
    tier: str
    arrival_s: float
    first_token_s: float | None = None
    finish_s: float | None = None
    num_prompt_tokens: int = 0
    num_output_tokens: int = 0
    num_preemptions: int = 0

    @property
    def ttft_s(self) -> float:
        assert self.first_token_s is not None
        return self.first_token_s - self.arrival_s


@dataclass
class SimulationResult:
    policy: str
    records: list[RequestRecord]
    makespan_s: float
    busy_s: float  # simulated time spent in steps
    num_preemptions: int
    # (time, tenant, weighted service) after every step, when trace_service is on
    service_trace: list[tuple[float, dict[str, float]]] = field(default_factory=list)

    def output_tokens_per_s(self) -> float:
        return sum(r.num_output_tokens for r in self.records) / self.makespan_s

    def total_tokens_per_s(self) -> float:
        num = sum(r.num_output_tokens + r.num_prompt_tokens for r in self.records)
        return num / self.makespan_s

    def ttfts(self, tier: str | None = None) -> list[float]:
        return sorted(r.ttft_s for r in self.records if tier is None or r.tier == tier)


def simulate(
    workload: Workload,
    policy: Policy,
    machine: SimulatedMachine,
    time_scale: float = 1.0,
    priorities: dict[str, int] | None = None,
    weights: dict[str, float] | None = None,
    trace_service: bool = False,
) -> SimulationResult:
    """Run the workload (arrival times multiplied by time_scale) to completion."""
    priorities = priorities or {"premium": 0, "standard": 1, "batch": 2}
    clock = SimulatedClock()
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=machine.max_num_batched_tokens,
            max_num_seqs=machine.max_num_seqs,
            max_model_len=4096,
        ),
        cache=CacheConfig(machine.block_size, reserved_fractions=policy.reserved_fractions),
        runner=RunnerConfig(num_kv_blocks=machine.num_kv_blocks),
    )
    runner = FakeModelRunner(
        config, machine.vocab_size, machine.cost_model, advance_clock=clock.advance
    )
    engine = LLMEngine(config, runner, policy.make_policy(), clock=clock)
    prompts = workload.prompts(machine.vocab_size)
    pending = sorted(workload.requests, key=lambda r: r.arrival_s)
    records: dict[str, RequestRecord] = {}
    service: dict[str, float] = {}
    trace: list[tuple[float, dict[str, float]]] = []
    busy = 0.0
    next_index = 0
    while next_index < len(pending) or engine.has_unfinished_requests():
        while next_index < len(pending) and pending[next_index].arrival_s * time_scale <= clock.now:
            r = pending[next_index]
            next_index += 1
            tenant = TenantContext(
                tenant_id=r.tenant,
                tier=r.tier,
                priority=priorities[r.tier],
                weight=(weights or {}).get(r.tenant, 1.0),
                cache_salt=r.tenant,
            )
            engine.add_request(
                r.request_id,
                prompts[r.request_id],
                SamplingParams(max_tokens=r.output_len, ignore_eos=True, temperature=0.0),
                tenant,
                arrival_time=r.arrival_s * time_scale,
            )
            records[r.request_id] = RequestRecord(
                r.request_id,
                r.tenant,
                r.tier,
                r.arrival_s * time_scale,
                num_prompt_tokens=r.prompt_len,
            )
        if not engine.has_unfinished_requests():
            clock.now = pending[next_index].arrival_s * time_scale
            continue
        started = clock.now
        outputs = engine.step()
        busy += clock.now - started
        for out in outputs:
            record = records[out.request_id]
            if out.new_token_ids and record.first_token_s is None:
                record.first_token_s = clock.now
            record.num_output_tokens = out.num_output_tokens
            if out.finished:
                record.finish_s = clock.now
                assert out.metrics is not None
                record.num_preemptions = out.metrics.num_preemptions
            if trace_service:
                # Weighted service as VTC counts it: prompt x1 once, output x2.
                if out.new_token_ids and out.num_output_tokens == 1:
                    service[record.tenant] = service.get(record.tenant, 0.0) + out.num_prompt_tokens
                service[record.tenant] = service.get(record.tenant, 0.0) + 2 * len(
                    out.new_token_ids
                )
        if trace_service:
            trace.append((clock.now, dict(service)))
    return SimulationResult(
        policy.name,
        list(records.values()),
        clock.now,
        busy,
        engine.scheduler.num_preemptions_total,
        trace,
    )


def premium_slo_scale(machine: SimulatedMachine, gpu_premium_ttft_slo_s: float) -> float:
    """Factor that scales GPU SLOs to the simulated machine: premium's GPU TTFT objective is
    taken as 10x an unloaded 1024-token prefill, and keeps that ratio here."""
    return 10 * machine.unloaded_ttft_s(1024) / gpu_premium_ttft_slo_s


def measure_capacity_rps(workload: Workload, machine: SimulatedMachine) -> float:
    """Requests per second the machine completes with everything queued at t=0 (FCFS)."""
    result = simulate(workload, fcfs_policy(), machine, time_scale=0.0)
    return len(result.records) / result.makespan_s


def main() -> None:
    from policies import TieredPolicy, TierTable

    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--workload", type=Path, required=True)
    parser.add_argument("--overload", type=float, default=2.0)
    args = parser.parse_args()
    workload = Workload.load(args.workload)
    machine = SimulatedMachine()
    capacity = measure_capacity_rps(workload, machine)
    scale = workload.rate_rps / (args.overload * capacity)
    tiers = TierTable()
    gpu_slo = tiers["premium"].ttft_slo_s
    assert gpu_slo is not None, "the premium tier has no TTFT objective"
    slo_scale = premium_slo_scale(machine, gpu_slo)
    scaled = tiers.scaled(slo_scale)
    tiered = Policy("tiered", TieredPolicy, tiers.reserved_fractions())
    print(f"capacity {capacity:.2f} req/s; offered {args.overload:.1f}x; SLO scale {slo_scale:.3f}")
    print(
        f"{'policy':8} {'prem p50':>9} {'prem p99':>9} {'prem SLO%':>9} {'std p99':>9} "
        f"{'std SLO%':>9} {'tok/s':>9} {'preempt':>8}"
    )
    for policy in (tiered, fcfs_policy()):
        result = simulate(workload, policy, machine, time_scale=scale)
        prem, std = result.ttfts("premium"), result.ttfts("standard")
        prem_slo, std_slo = scaled["premium"].ttft_slo_s, scaled["standard"].ttft_slo_s
        assert prem_slo is not None and std_slo is not None
        print(
            f"{policy.name:8} {percentile(prem, 50):9.3f} {percentile(prem, 99):9.3f} "
            f"{100 * sum(t <= prem_slo for t in prem) / len(prem):9.1f} "
            f"{percentile(std, 99):9.3f} {100 * sum(t <= std_slo for t in std) / len(std):9.1f} "
            f"{result.total_tokens_per_s():9.0f} {result.num_preemptions:8d}"
        )


if __name__ == "__main__":
    main()
