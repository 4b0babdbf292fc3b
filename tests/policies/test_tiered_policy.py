"""The tiered policy's choices, without an engine: a recording StepBuilder stands in for the
scheduler and says what the policy asked of it."""

from __future__ import annotations

import contextlib
from collections.abc import Iterable, Iterator, Mapping, Sequence

import pytest

from engine import (
    AdmissionGate,
    FCFSQueue,
    Request,
    RequestStatus,
    SamplingParams,
    Verdict,
)
from policies import PolicyError, TieredPolicy, TieredPolicyConfig
from policies.tier_shares import TierShares


class RecordingStep:
    """Records the policy's calls; run() schedules nothing, so the budget stays as set."""

    def __init__(self, running: list[Request], num_steps: int = 100, budget: int = 64) -> None:
        self._running = running
        self.num_steps = num_steps
        self.budget = budget
        self.short_of_blocks = False
        self.calls: list[tuple[str, list[str]] | tuple[str, AdmissionGate | None]] = []
        self.blocks: dict[str, int] = {}
        self._scheduled: dict[str, int] = {}

    @property
    def running(self) -> Sequence[Request]:
        return self._running

    @property
    def scheduled(self) -> Mapping[str, int]:
        return self._scheduled

    def blocks_held(self, request: Request) -> int:
        return self.blocks.get(request.request_id, 1)

    def run(self, requests: Iterable[Request]) -> None:
        self.calls.append(("run", [r.request_id for r in requests]))

    def admit(self, gate: AdmissionGate | None = None) -> None:
        self.calls.append(("admit", gate))

    @contextlib.contextmanager
    def capped(self, max_tokens: int) -> Iterator[None]:
        self.calls.append(("capped", None))
        yield


def running_request(request_id: str, tenant: str, priority: int = 1, prefill_done: bool = True,
                    admitted_step: int = 0, admission_seq: int = 0) -> Request:
    r = Request(request_id, list(range(8)), SamplingParams(max_tokens=4), arrival_time=0.0,
                tenant_id=tenant, priority=priority)
    r.status = RequestStatus.RUNNING
    if prefill_done:  # a decode: one token sampled, its KV not computed yet
        r.output_token_ids.append(1)
        r.num_computed_tokens = 8
    else:
        r.num_computed_tokens = 4
    r.admitted_step = admitted_step
    r.admission_seq = admission_seq
    return r


def runs(step: RecordingStep) -> list[list[str]]:
    return [ids for kind, ids in step.calls if kind == "run" and isinstance(ids, list)]


def test_without_fair_sharing_decodes_then_prefills_by_tier_then_admissions() -> None:
    policy = TieredPolicy(FCFSQueue(), TieredPolicyConfig(fair_share=False))
    running = [
        running_request("std-prefill", "a", 1, prefill_done=False),
        running_request("std-decode", "a", 1),
        running_request("prem-decode", "b", 0),
        running_request("prem-prefill", "b", 0, prefill_done=False),
    ]
    step = RecordingStep(running)
    policy.build_step(step, now_s=0.0)
    assert runs(step) == [["prem-decode", "std-decode"], ["prem-prefill", "std-prefill"]]
    assert step.calls[-1] == ("admit", None)


def test_a_light_tenants_prefill_goes_before_the_decodes_of_its_tier() -> None:
    policy = TieredPolicy(FCFSQueue())
    heavy = [running_request(f"h{i}", "heavy", admission_seq=i) for i in range(5)]
    light = running_request("l0", "light", prefill_done=False, admission_seq=5)
    step = RecordingStep([*heavy, light])
    policy.build_step(step, now_s=0.0)
    # light holds 1 of 6 places, under half its share of 3: its prompt goes first.
    assert runs(step)[0] == ["l0"]
    assert runs(step)[1] == [f"h{i}" for i in range(5)]


def test_a_lane_step_carries_only_the_light_prompt_at_most_every_n_steps() -> None:
    policy = TieredPolicy(FCFSQueue(), TieredPolicyConfig(under_share_lane_every_steps=4))
    heavy = [running_request(f"h{i}", "heavy", admission_seq=i) for i in range(5)]
    light = running_request("l0", "light", prefill_done=False, admission_seq=5)
    step = RecordingStep([*heavy, light], num_steps=10)
    step._scheduled["l0"] = 4  # the light prompt was scheduled, budget left over
    policy.build_step(step, now_s=0.0)
    assert runs(step) == [["l0"]] and policy.num_lane_steps == 1
    again = RecordingStep([*heavy, light], num_steps=12)  # 2 steps later: no lane yet
    again._scheduled["l0"] = 4
    policy.build_step(again, now_s=0.0)
    assert len(runs(again)) > 1 and policy.num_lane_steps == 1


def test_growth_takes_from_the_least_important_tier_first_then_the_latest_admitted() -> None:
    policy = TieredPolicy(FCFSQueue())
    me = running_request("me", "a", 1, admission_seq=1)
    premium = running_request("p", "b", 0, admission_seq=0)
    batch_small = running_request("b-small", "c", 2, admission_seq=2)
    batch_big = running_request("b-big", "c", 2, admission_seq=3)
    later = running_request("later", "a", 1, admission_seq=4)
    step = RecordingStep([premium, me, batch_small, batch_big, later])
    step.blocks = {"b-small": 1, "b-big": 5}
    candidates = list(step.running)
    assert policy.growth_victim(me, candidates, step) is batch_big  # most blocks
    without_batch = [premium, me, later]
    assert policy.growth_victim(me, without_batch, step) is later  # never premium
    assert policy.growth_victim(me, [premium, me], step) is me  # gives way itself


def test_admission_victims_respect_the_thrash_guard_and_fair_shares() -> None:
    policy = TieredPolicy(FCFSQueue())
    new = Request("new", list(range(4)), SamplingParams(max_tokens=4), arrival_time=1.0,
                  tenant_id="light", priority=1)
    old_batch = running_request("old-batch", "x", 2, admitted_step=0)
    fresh_batch = running_request("fresh-batch", "x", 2, admitted_step=99)
    heavy = [running_request(f"h{i}", "heavy", 1, admitted_step=0) for i in range(4)]
    step = RecordingStep([old_batch, fresh_batch, *heavy], num_steps=100)
    victims = policy.admission_victims(new, step)
    # The batch request admitted a step ago is guarded; the heavy tenant keeps its share
    # (5 places, 2.5 each) after giving up one of its 4.
    assert victims[0] is old_batch and fresh_batch not in victims
    assert set(victims[1:]) == set(heavy)
    assert policy.payer(old_batch, new) is new  # a more important tier pays
    assert policy.payer(heavy[0], new) is heavy[0]  # over its share, the victim pays
    no_fair = TieredPolicy(FCFSQueue(), TieredPolicyConfig(fair_share=False))
    assert no_fair.admission_victims(new, step) == [old_batch]


def test_the_under_share_gate_admits_light_tenants_of_the_first_tier_only() -> None:
    policy = TieredPolicy(FCFSQueue())
    heavy = [running_request(f"h{i}", "heavy", 1) for i in range(4)]
    step = RecordingStep(heavy)
    for tenant, priority in (("light", 1), ("heavy", 1), ("light", 2)):
        policy.waiting.add(Request(f"w-{tenant}-{priority}", [1, 2], SamplingParams(),
                                   arrival_time=0.0, tenant_id=tenant, priority=priority))
    policy.build_step(step, now_s=0.0)
    gates = [gate for kind, gate in step.calls if kind == "admit" and gate is not None]
    assert len(gates) == 1
    gate = gates[0]
    assert gate is not None
    waiting = list(policy.waiting)
    assert gate.consider(waiting[0]) is Verdict.ADMIT  # light, tier 1
    assert gate.consider(waiting[1]) is Verdict.PASS  # heavy holds every place
    assert gate.consider(waiting[2]) is Verdict.STOP  # a less important tier


def test_tier_shares_weigh_tenants() -> None:
    running = [running_request("a0", "a"), running_request("a1", "a"),
               running_request("b0", "b")]
    running[2].weight = 2.0
    shares = TierShares.of(1, running, {})
    assert shares.load("a") == 2.0 and shares.load("b") == 0.5
    assert not shares.is_light("a") and not shares.is_light("b")
    light_sender = TierShares.of(1, running, {1: frozenset({"b"})})
    assert light_sender.is_light("b")  # holds 1 of its share of 2, while sending little


def test_settings_out_of_range_are_refused() -> None:
    with pytest.raises(PolicyError):
        TieredPolicyConfig(under_share_lane_every_steps=-1)
