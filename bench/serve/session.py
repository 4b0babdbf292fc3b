"""A server ready to be benchmarked, and one run against it: plan the workload's prompts,
send them open-loop, summarize per tier and tenant."""

from __future__ import annotations

import asyncio
from collections.abc import Iterable
from dataclasses import dataclass, replace

from bench.serve.engine_activity import EngineActivity, read_engine_activity
from bench.serve.loadgen import ClientLoopLag, LoadGenerator, RequestResult
from bench.serve.machine import CpuTicks, read_cpu_ticks
from bench.serve.plan import PromptVocabulary, plan_requests
from bench.serve.provision import provision_tenants, served_model_name
from bench.serve.stats import RunSummary, summarize
from bench.workload import Workload
from policies import TierTable

__all__ = ["BenchTarget", "RunRecord"]


@dataclass(frozen=True)
class RunRecord:
    """One run: its summary, every request's result, what the server's engine did meanwhile
    (None when the server does not serve those counters), and the share of this machine's
    CPU time the hypervisor took for other guests (None without /proc/stat): a run with
    much steal ran on a slower machine than its neighbours. client_loop_lag: the load
    generator's own event loop during an open-loop run."""

    summary: RunSummary
    results: list[RequestResult]
    engine: EngineActivity | None = None
    host_steal_share: float | None = None
    client_loop_lag: ClientLoopLag | None = None
    # What the engine did from the first send to the last (the window of the tokens/s
    # "while arrivals last"); None for closed-loop runs or without the counters.
    engine_while_arriving: EngineActivity | None = None


@dataclass(frozen=True)
class BenchTarget:
    """A server with a key per workload tenant."""

    base_url: str
    model: str  # the served model id
    keys: dict[str, str]  # workload tenant -> API key
    vocabulary: PromptVocabulary
    progress: bool = True  # draw a progress bar during runs

    @classmethod
    def provision(
        cls,
        base_url: str,
        admin_token: str,
        tenant_tiers: Iterable[tuple[str, str]],
        vocabulary: PromptVocabulary,
        *,
        progress: bool = True,
    ) -> BenchTarget:
        """Create the tenants (workload tenant, tier) on the server and get their keys."""
        keys = provision_tenants(base_url, admin_token, dict(tenant_tiers))
        model = served_model_name(base_url, next(iter(keys.values())))
        return cls(base_url, model, keys, vocabulary, progress)

    def run(
        self, workload: Workload, label: str, tiers: TierTable, offered_rps: float | None = None
    ) -> RunRecord:
        """Send the workload at its arrival times (open loop); offered_rps defaults to its
        rate."""
        generator = self._generator()
        plan = plan_requests(workload, self.vocabulary)
        at_last_send: list[EngineActivity | None] = []
        before = self._readings()
        results = asyncio.run(generator.run(
            plan, label,
            before_last_send=lambda: at_last_send.append(read_engine_activity(self.base_url)),
        ))
        rate = workload.rate_rps if offered_rps is None else offered_rps
        record = self._record(summarize(label, rate, results, tiers), results, before)
        engine_before, window_end = before[0], (at_last_send or [None])[0]
        while_arriving = (
            None if engine_before is None or window_end is None
            else window_end.minus(engine_before)
        )
        return replace(record, client_loop_lag=generator.loop_lag,
                       engine_while_arriving=while_arriving)

    def run_closed_loop(
        self,
        workload: Workload,
        concurrency: int,
        label: str,
        tiers: TierTable,
        *,
        num_to_complete: int | None = None,
    ) -> RunRecord:
        """Send the workload's requests in order with `concurrency` of them in flight (see
        LoadGenerator.run_closed_loop)."""
        generator = self._generator()
        plan = plan_requests(workload, self.vocabulary)
        before = self._readings()
        results = asyncio.run(
            generator.run_closed_loop(plan, concurrency, label, num_to_complete=num_to_complete)
        )
        return self._record(summarize(label, 0.0, results, tiers), results, before)

    def _readings(self) -> tuple[EngineActivity | None, CpuTicks | None]:
        return read_engine_activity(self.base_url), read_cpu_ticks()

    def _record(
        self,
        summary: RunSummary,
        results: list[RequestResult],
        before: tuple[EngineActivity | None, CpuTicks | None],
    ) -> RunRecord:
        (engine_before, ticks_before), (engine_after, ticks_after) = before, self._readings()
        engine = steal = None
        if engine_before is not None and engine_after is not None:
            engine = engine_after.minus(engine_before)
        if ticks_before is not None and ticks_after is not None:
            steal = ticks_after.steal_share_since(ticks_before)
        return RunRecord(summary, results, engine, steal)

    def _generator(self) -> LoadGenerator:
        return LoadGenerator(self.base_url, self.model, self.keys, progress=self.progress)
