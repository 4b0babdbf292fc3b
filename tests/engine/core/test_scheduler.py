"""The scheduler's mechanism against its output, under a trivial policy the test scripts:
token budget and chunking, the order a policy gives, places and blocks, preemption by
recompute (all or nothing, the payer the policy names), admission gates, forks, the prefix
cache, and what is sent to the runner once."""

from __future__ import annotations

from collections.abc import Callable

from engine import (
    AdmissionGate,
    FCFSQueue,
    ModelRunnerOutput,
    Request,
    RequestStatus,
    SamplingParams,
    SchedulerConfig,
    SchedulerOutput,
    StepBuilder,
    Verdict,
)
from engine.core.kv_cache.kv_manager import KVCacheManager
from engine.core.scheduler import Scheduler

BLOCK = 4


class ScriptedPolicy:
    """Runs the running requests in the order `order` gives, then admits through `gate`;
    victims and payers as the test sets them."""

    preempts_by_priority = False
    num_lane_steps = 0

    def __init__(self) -> None:
        self.waiting = FCFSQueue()
        self.order: Callable[[list[Request]], list[Request]] = lambda running: running
        self.gate: AdmissionGate | None = None
        self.victims: list[Request] = []  # offered to every admission that needs room
        self.growth: Callable[[Request, list[Request]], Request] = lambda r, c: r
        self.payers: list[tuple[Request, Request]] = []  # (victim, request) asked about

    def build_step(self, step: StepBuilder, now_s: float) -> None:
        step.run(self.order(list(step.running)))
        step.admit(self.gate)

    def growth_victim(self, request: Request, candidates: list[Request], step: StepBuilder
                      ) -> Request:
        return self.growth(request, candidates)

    def admission_victims(self, request: Request, step: StepBuilder) -> list[Request]:
        return [v for v in self.victims if v.status is RequestStatus.RUNNING]

    def payer(self, victim: Request, request: Request) -> Request:
        self.payers.append((victim, request))
        return request

    def record_sent(self, priority: int, tenant_id: str, weight: float, num_tokens: int,
                    now_s: float) -> None:
        return None


def make(
    num_blocks: int = 32, budget: int = 16, max_num_seqs: int = 8, prefix_caching: bool = False
) -> tuple[Scheduler, ScriptedPolicy]:
    policy = ScriptedPolicy()
    config = SchedulerConfig(max_num_batched_tokens=budget, max_num_seqs=max_num_seqs,
                             max_model_len=256)
    kv = KVCacheManager(num_blocks, BLOCK, prefix_caching)
    return Scheduler(config, kv, policy), policy


def request(request_id: str, num_prompt: int, max_tokens: int = 8, tenant: str = "t",
            first: int = 0) -> Request:
    return Request(
        request_id,
        list(range(first, first + num_prompt)),
        SamplingParams(max_tokens=max_tokens, ignore_eos=True),
        arrival_time=0.0,
        tenant_id=tenant,
        max_tokens=max_tokens,
    )


def finish_step(scheduler: Scheduler, output: SchedulerOutput) -> None:
    """What the engine does after the runner: one token for every chunk that samples."""
    sampled = {c.request_id: 7 for c in output.chunks if c.needs_sample}
    requests = scheduler.chunk_requests(output)
    scheduler.update_from_output(output, ModelRunnerOutput(list(sampled), list(sampled.values())),
                                 0.0, requests, [r.admission_seq for r in requests])


def chunks(output: SchedulerOutput) -> list[tuple[str, int, int, bool, bool]]:
    return [(c.request_id, c.start_pos, c.num_tokens, c.needs_sample, c.is_prefill)
            for c in output.chunks]


def test_the_budget_is_spent_in_chunks_and_decodes_come_first_in_the_output() -> None:
    scheduler, _ = make(budget=16)
    a, b = request("a", 10), request("b", 10, first=100)
    scheduler.add_request(a)
    scheduler.add_request(b)
    out = scheduler.schedule(0.0)
    assert chunks(out) == [("a", 0, 10, True, True), ("b", 0, 6, False, True)]
    assert out.num_batched_tokens == 16 and out.step_id == 0
    # Each joining request's data and whole block table go with it, once.
    assert [(n.request_id, len(n.block_ids)) for n in out.new_requests] == [("a", 3), ("b", 2)]
    finish_step(scheduler, out)
    out = scheduler.schedule(0.0)
    assert chunks(out) == [("a", 10, 1, True, False), ("b", 6, 4, True, True)]
    assert out.new_requests == []
    # b's table grew by one block; a's third block has room for its 11th token.
    assert out.block_updates == {"b": (2, scheduler.kv.block_ids("b", 2))}


def test_the_policy_orders_who_takes_the_budget() -> None:
    scheduler, policy = make(budget=16)
    scheduler.add_request(request("r0", 10))
    scheduler.add_request(request("r1", 30, first=100))
    finish_step(scheduler, scheduler.schedule(0.0))  # r0's prompt and 6 of r1's
    policy.order = lambda running: running[::-1]
    out = scheduler.schedule(0.0)
    # r1's prompt first takes the whole budget: r0's decode waits (in running order, it
    # would have gone first and left r1 15 tokens).
    assert chunks(out) == [("r1", 6, 16, False, True)]
    assert scheduler.requests["r0"].num_computed_tokens == 10


def test_a_full_batch_blocks_its_head_and_nobody_overtakes_it() -> None:
    scheduler, _ = make(max_num_seqs=1, budget=64)
    scheduler.add_request(request("a", 8))
    scheduler.add_request(request("b", 8, first=100))
    scheduler.add_request(request("c", 2, first=200))
    out = scheduler.schedule(0.0)
    assert [c.request_id for c in out.chunks] == ["a"]
    assert scheduler.blocked_priority == 1  # b's class: no place and no victim offered
    assert {r.request_id for r in scheduler.waiting} == {"b", "c"}


def test_admission_preempts_the_offered_victims_all_or_nothing_and_the_payer_is_charged() -> None:
    scheduler, policy = make(num_blocks=6, budget=64)
    low = request("low", 16, tenant="low")
    scheduler.add_request(low)
    finish_step(scheduler, scheduler.schedule(0.0))  # low holds 5 of the 6 blocks
    # A 12-token prompt needs 3 blocks: without a victim it waits, nobody is preempted.
    high = request("high", 12, tenant="high", first=500)
    scheduler.add_request(high)
    out = scheduler.schedule(0.0)
    assert chunks(out) == [("low", 16, 1, True, False)]
    assert low.status is RequestStatus.RUNNING and high.status is RequestStatus.WAITING
    finish_step(scheduler, out)
    policy.victims = [low]
    out = scheduler.schedule(0.0)
    assert chunks(out) == [("high", 0, 12, True, True)]
    assert low.status is RequestStatus.PREEMPTED and low.num_computed_tokens == 0
    assert low.num_computed_high_water == 17 and low.num_preemptions == 1
    assert low.preempted_by_tenant_id == "high" and policy.payers == [(low, high)]
    assert out.removed_request_ids == {"low"}  # the runner drops it before the new one
    assert next(iter(scheduler.waiting)) is low  # back at the head, its tokens kept
    assert low.num_tokens == 18


def test_a_request_that_cannot_grow_takes_the_blocks_of_the_victim_the_policy_names() -> None:
    scheduler, policy = make(num_blocks=4, budget=64)
    a, b = request("a", 8), request("b", 8, first=100)
    scheduler.add_request(a)
    scheduler.add_request(b)
    finish_step(scheduler, scheduler.schedule(0.0))  # 2 + 2 blocks, both full
    policy.growth = lambda r, candidates: next(c for c in candidates if c is not r)
    out = scheduler.schedule(0.0)
    # a grows first and b gives way; b then finds itself preempted and is passed over.
    assert chunks(out) == [("a", 8, 1, True, False)]
    assert b.status is RequestStatus.PREEMPTED and b.preempted_by_tenant_id == "t"
    assert out.removed_request_ids == {"b"}


def test_a_request_named_as_its_own_victim_gives_way() -> None:
    scheduler, _ = make(num_blocks=4, budget=64)  # the default growth policy: itself
    a, b = request("a", 8), request("b", 8, first=100)
    scheduler.add_request(a)
    scheduler.add_request(b)
    finish_step(scheduler, scheduler.schedule(0.0))
    out = scheduler.schedule(0.0)
    # a gave way to its own growth; b then grows into the blocks a gave up.
    assert a.status is RequestStatus.PREEMPTED and a.preempted_by_tenant_id == "t"
    assert chunks(out) == [("b", 8, 1, True, False)]
    assert out.removed_request_ids == {"a"}


class _Gate:
    """Passes over tenant "skip", stops at tenant "stop", admits the rest."""

    def __init__(self) -> None:
        self.admitted_ids: list[str] = []

    def consider(self, request: Request) -> Verdict:
        return {"skip": Verdict.PASS, "stop": Verdict.STOP}.get(request.tenant_id, Verdict.ADMIT)

    def admitted(self, request: Request) -> None:
        self.admitted_ids.append(request.request_id)


def test_an_admission_gate_passes_over_a_tenant_or_ends_the_pass() -> None:
    scheduler, policy = make(budget=64)
    gate = _Gate()
    policy.gate = gate
    for name, tenant in (("s0", "skip"), ("a0", "a"), ("s1", "skip"), ("x0", "stop"),
                         ("a1", "a")):
        scheduler.add_request(request(name, 4, tenant=tenant, first=10 * len(name + tenant)))
    out = scheduler.schedule(0.0)
    assert [c.request_id for c in out.chunks] == ["a0"]
    assert gate.admitted_ids == ["a0"]


def test_a_later_sample_forks_the_first_samples_prompt_once_it_is_written() -> None:
    scheduler, _ = make(budget=8)
    parent = request("g#0", 12)
    child = request("g#1", 12)
    child.fork_parent = parent
    scheduler.add_request(parent)
    scheduler.add_request(child)
    out = scheduler.schedule(0.0)
    assert chunks(out) == [("g#0", 0, 8, False, True)]  # the child waits for the prompt
    finish_step(scheduler, out)
    out = scheduler.schedule(0.0)
    # The parent's last 4 prompt tokens are scheduled, not written: still no fork.
    assert chunks(out) == [("g#0", 8, 4, True, True)]
    finish_step(scheduler, out)
    out = scheduler.schedule(0.0)
    # Forked: the child recomputes only the prompt's last token, in its own copy of the block.
    assert ("g#1", 11, 1, True, True) in chunks(out)
    assert scheduler.kv.block_ids("g#1")[:2] == scheduler.kv.block_ids("g#0")[:2]
    assert out.blocks_to_copy  # copy-on-write of the shared last block


def test_a_prefix_cache_hit_is_not_computed_again() -> None:
    scheduler, _ = make(budget=64, prefix_caching=True)
    first = request("first", 10)
    scheduler.add_request(first)
    finish_step(scheduler, scheduler.schedule(0.0))
    second = request("second", 10)  # the same prompt: its two full blocks are cached
    scheduler.add_request(second)
    out = scheduler.schedule(0.0)
    assert ("second", 8, 2, True, True) in chunks(out)
    assert second.num_cached_tokens == 8


def test_ended_requests_are_dropped_by_the_runner_and_a_failed_step_sends_that_again() -> None:
    scheduler, _ = make(budget=64)
    scheduler.add_request(request("a", 4))
    scheduler.add_request(request("b", 4, first=100))
    finish_step(scheduler, scheduler.schedule(0.0))
    freed_before = scheduler.kv.pool.num_free_blocks
    scheduler.finish_request("a", RequestStatus.FINISHED_ABORTED)
    assert scheduler.kv.pool.num_free_blocks > freed_before  # at once, not at the next step
    out = scheduler.schedule(0.0)
    assert out.removed_request_ids == {"a"}
    scheduler.step_failed(out)
    again = scheduler.schedule(0.0)
    assert again.removed_request_ids == {"a"} and again.step_id == out.step_id + 1
