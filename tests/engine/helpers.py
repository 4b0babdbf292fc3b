"""Factories and invariant checks for engine tests; no model needed (FakeModelRunner)."""

from __future__ import annotations

import time
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any, cast

from engine import (
    CacheConfig,
    EngineConfig,
    FCFSPolicy,
    FCFSQueue,
    LLMEngine,
    LoraConfig,
    RunnerConfig,
    SamplingParams,
    SchedulerConfig,
    SchedulingPolicy,
    TenantContext,
    WaitingQueue,
)
from engine.core.request import RequestStatus
from engine.testing.clock import SimulatedClock
from engine.testing.fake_runner import FakeModelRunner, fake_next_token
from policies import TieredPolicy, TieredPolicyConfig

VOCAB = 1000

# Whether make_engine's engines schedule asynchronously when not told; the fixture
# `scheduling_mode` (tests/engine/conftest.py) runs a module's tests both ways.
ASYNC_SCHEDULING = False


def make_engine(
    num_blocks: int = 64,
    block_size: int = 4,
    max_num_batched_tokens: int = 64,
    max_num_seqs: int = 8,
    reserved: dict[int, float] | None = None,
    queue: WaitingQueue | None = None,
    priority_preemption: bool = True,
    prefix_caching: bool = True,
    max_model_len: int = 512,
    under_share_lane_every_steps: int = 4,
    clock: Callable[[], float] | None = None,
    async_scheduling: bool | None = None,
    max_loras: int = 4,
    background_priority: int | None = None,
) -> LLMEngine:
    """An engine over the fake runner (max_loras adapter slots). Without clock its clock is
    simulated, each step moving it by the fake runner's modelled step time, so what the
    scheduler reads of time (what tenants sent lately) replays exactly; given clock (one the
    test moves, or real time for a runner that sleeps), the runner leaves it alone."""
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=max_model_len,
        ),
        cache=CacheConfig(block_size, prefix_caching, reserved or {}),
        async_scheduling=ASYNC_SCHEDULING if async_scheduling is None else async_scheduling,
        runner=RunnerConfig(num_kv_blocks=num_blocks),
        lora=LoraConfig(max_loras=max_loras, max_cpu_loras=max(max_loras, 1)),
    )
    if clock is None:
        clock = SimulatedClock()
        runner = FakeModelRunner(config, VOCAB, advance_clock=clock.advance)
    else:
        runner = FakeModelRunner(config, VOCAB)
    waiting = queue if queue is not None else FCFSQueue()
    lane_steps = under_share_lane_every_steps
    policy: SchedulingPolicy = (
        TieredPolicy(waiting, TieredPolicyConfig(under_share_lane_every_steps=lane_steps,
                                                 background_priority=background_priority))
        if priority_preemption
        else FCFSPolicy(waiting)
    )
    return LLMEngine(config, runner, policy, clock=clock)


def preempting_engine() -> LLMEngine:
    """Two requests added, whose KV outgrows the 6-block pool as they decode: run to the end,
    the engine preempts one and recomputes it."""
    engine = make_engine(num_blocks=6, block_size=4, max_num_batched_tokens=32)
    tenant = TenantContext(tenant_id="b", tier="standard", priority=1)
    for i in range(2):
        engine.add_request(f"s{i}", list(range(10 * i, 10 * i + 8)),
                           SamplingParams(max_tokens=8, ignore_eos=True), tenant)
    return engine


def reference_output(prompt: list[int], num_tokens: int) -> list[int]:
    """What an unpreempted, unpaged run produces: token = f(context)."""
    context = list(prompt)
    for _ in range(num_tokens):
        context.append(fake_next_token(context, VOCAB))
    return context[len(prompt) :]


def check_invariants(engine: LLMEngine) -> None:
    """Block ownership, reference counts, reservations, tenant caps, KV contents, and the
    statistics' per-tier counts against a walk over the running and waiting requests."""
    _check_stats(engine)
    kv = engine.kv
    pool = kv.pool
    occurrences: Counter[int] = Counter()
    for request in engine.scheduler.requests.values():
        table = kv.block_ids(request.request_id)
        assert len(table) == len(set(table)), "a block twice in one table"
        occurrences.update(table)
        if request.status != RequestStatus.RUNNING:
            assert not table, "a request that is not running holds blocks"
    for block in pool.blocks:
        assert block.ref_cnt >= 0
        assert block.ref_cnt == occurrences[block.block_id], (
            f"block {block.block_id}: ref_cnt {block.ref_cnt} but held "
            f"{occurrences[block.block_id]} times"
        )
        is_free = block.block_id in pool._free_uncached or block.block_id in pool._free_cached
        assert is_free == (block.ref_cnt == 0), f"block {block.block_id} free-list state wrong"
    assert pool.num_free_blocks == sum(1 for b in pool.blocks if b.ref_cnt == 0)
    # Reservations: less important tiers never hold blocks reserved for more important ones.
    priorities = set(kv.reserved_blocks) | {r.priority for r in engine.scheduler.requests.values()}
    for p in priorities:
        lower = set()
        for request in engine.scheduler.running:
            if request.priority > p:
                lower.update(kv.block_ids(request.request_id))
        reserved_above = sum(n for q, n in kv.reserved_blocks.items() if q <= p)
        assert len(lower) <= kv.num_blocks - reserved_above, f"reservation of tier {p} broken"
    # Tenant caps.
    held: dict[str, set[int]] = {}
    for request in engine.scheduler.running:
        held.setdefault(request.tenant_id, set()).update(kv.block_ids(request.request_id))
        if request.kv_cap_blocks is not None:
            assert len(held[request.tenant_id]) <= request.kv_cap_blocks, "tenant cap exceeded"
    # KV contents: what each running request reads back is its own token sequence.
    runner = engine.runner
    assert isinstance(runner, FakeModelRunner)
    for request in engine.scheduler.running:
        written = request.num_computed_tokens  # after step() every scheduled chunk ran
        if written:
            context = runner._read_context(kv.block_ids(request.request_id), written)
            assert context == request.all_token_ids[:written], "KV holds foreign tokens"
    # What the runner keeps, updated step by step, equals the scheduler's view built afresh.
    batch = runner.input_batch
    for request in engine.scheduler.running:
        table = kv.block_ids(request.request_id)
        row = batch.block_table(request.request_id)
        assert row[: len(table)].tolist() == table and not row[len(table) :].any(), "stale table"
        assert batch.token_ids(request.request_id).tolist() == request.all_token_ids


def run_to_completion(
    engine: LLMEngine, max_steps: int = 100_000
) -> dict[tuple[str, int], list[int]]:
    outputs: dict[tuple[str, int], list[int]] = {}
    for _ in range(max_steps):
        if not engine.has_unfinished_requests():
            return outputs
        for out in engine.step():
            outputs.setdefault((out.request_id, out.sample_index), []).extend(out.new_token_ids)
        check_invariants(engine)
    raise AssertionError("engine did not finish")


def _check_stats(engine: LLMEngine) -> None:
    """The snapshot's tiers (kept incrementally for the waiting queue) against a recount."""
    expected: dict[int, tuple[int, int, Counter[str]]] = {}
    scheduler = engine.scheduler
    for request in [*scheduler.running, *scheduler.waiting]:
        num_running, num_waiting, pending = expected.get(request.priority, (0, 0, Counter()))
        if request.status == RequestStatus.RUNNING:
            num_running += 1
            if not request.is_prefill_done:
                pending[request.tenant_id] += request.num_uncomputed_tokens
        else:
            num_waiting += 1
            pending[request.tenant_id] += request.num_tokens
        expected[request.priority] = (num_running, num_waiting, pending)
    tiers = engine.stats().tiers
    assert tiers.keys() == expected.keys()
    for priority, (num_running, num_waiting, pending) in expected.items():
        stats = tiers[priority]
        assert (stats.num_running, stats.num_waiting) == (num_running, num_waiting), priority
        assert stats.num_pending_prefill_tokens == sum(pending.values()), priority
        assert {t: n for t, n in stats.pending_prefill_tokens_by_tenant.items() if n} == {
            t: n for t, n in pending.items() if n
        }, priority


def sleeping_engine(step_delay_s: float = 0.0) -> LLMEngine:
    """An engine over the fake runner in real time (its steps sleep the modelled step time
    plus step_delay_s): what tests build in an engine process (a module-level function, so
    the spawned process can unpickle it)."""
    engine = make_engine(num_blocks=64, block_size=4, clock=time.monotonic)
    runner = engine.runner
    assert isinstance(runner, FakeModelRunner)
    runner.sleep = True
    runner.extra_delay_s = step_delay_s
    return engine


def engine_without_weights() -> LLMEngine:
    """A build that fails, as loading a missing checkpoint does."""
    raise FileNotFoundError("no checkpoint at /nonexistent/model.safetensors")


def engine_noting_refusals(path: Path) -> LLMEngine:
    """sleeping_engine whose record_refused also writes "tenant tokens" lines to path: how a
    test in another process sees the refusals the engine's process applied."""
    engine = sleeping_engine()

    def noted(num_prompt_tokens: int, tenant: TenantContext) -> None:
        engine.record_refused(num_prompt_tokens, tenant)
        with path.open("a") as file:
            file.write(f"{tenant.tenant_id} {num_prompt_tokens}\n")

    return wrapped_engine(engine, record_refused=noted)


class _WrappedEngine:
    def __init__(self, engine: LLMEngine, methods: dict[str, Callable[..., Any]]) -> None:
        self._engine = engine
        self.__dict__.update(methods)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._engine, name)


def wrapped_engine(engine: LLMEngine, **methods: Callable[..., Any]) -> LLMEngine:
    """engine, with the given methods in place of its own: a test that observes or replaces
    an engine method wraps the engine rather than patch it, so the engine under test stays
    the class it is."""
    return cast(LLMEngine, _WrappedEngine(engine, methods))
