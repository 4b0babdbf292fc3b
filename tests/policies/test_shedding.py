"""SLO shedding over fabricated scheduler statistics."""

from __future__ import annotations

import pytest

from engine import SchedulerStats, TierStats
from engine.core.rates import Arrivals
from policies import AdmissionConfigError, RefusalReason, ShedConfig, SloShedder, TierTable
from policies.queue_wait import TenantShare, estimate_queue_wait_s

RATE = 1000.0  # prefill tokens per second the engine drains


def _stats(
    pending: dict[int, int],
    premium_blocks: tuple[int, int] = (0, 300),
    priority_preemption: bool = True,
) -> SchedulerStats:
    """An engine with `pending` prefill tokens per priority; premium holds (used, reserved)."""
    names = {0: "premium", 1: "standard", 2: "batch"}
    tiers = {
        p: TierStats(p, names[p], num_waiting=1, num_pending_prefill_tokens=n)
        for p, n in pending.items()
    }
    if 0 in tiers:
        tiers[0].num_kv_blocks, tiers[0].num_kv_blocks_reserved = premium_blocks
    return SchedulerStats(
        tiers=tiers,
        num_kv_blocks_total=1000,
        num_kv_blocks_used=1000,
        prefill_tokens_per_s=RATE,
        priority_preemption=priority_preemption,
    )


def test_standard_is_shed_until_the_backlog_ahead_drains_to_the_threshold() -> None:
    shedder = SloShedder(TierTable(), ShedConfig(slo_fraction=0.8))
    assert shedder.thresholds_s == {"premium": 0.4, "standard": 1.6, "batch": None}
    stats = _stats({0: 400, 1: 2600, 2: 50_000})
    # ahead of a 200-token standard prompt: premium 400 + standard 2600 -> 3.2 s
    shed = shedder.check(stats, "standard", 200)
    assert shed is not None and shed.reason is RefusalReason.SHED
    assert shed.estimated_wait_s == pytest.approx(3.2)
    assert shed.threshold_s == pytest.approx(1.6)
    # retry_after is the time until it fits with its own prompt's time (0.2 s) to spare
    assert shed.retry_after_s == pytest.approx(1.8)
    assert shed.should_retry
    assert "standard tier" in shed.message and "retry after 1.8s" in shed.message
    # the backlog drained for that long leaves it a 1.4 s wait: admitted
    drained_tokens = round(shed.retry_after_s * RATE)
    drained = _stats({0: 0, 1: 400 + 2600 - drained_tokens, 2: 50_000})
    assert estimate_queue_wait_s(drained, 1, 200) == pytest.approx(1.4)
    assert shedder.check(drained, "standard", 200) is None
    # while 10 tokens over the threshold are still ahead, it is shed
    almost = _stats({0: 0, 1: 400 + 2600 - drained_tokens + 200 + 10, 2: 50_000})
    assert shedder.check(almost, "standard", 200) is not None


def test_retry_after_has_a_floor() -> None:
    shedder = SloShedder(TierTable(), ShedConfig(slo_fraction=1.0, min_retry_after_s=0.25))
    shed = shedder.check(_stats({1: 1990}), "standard", 20)  # 2.01 s against 2 s
    assert shed is not None and shed.retry_after_s == 0.25


def test_premium_is_admitted_while_its_reservation_has_room() -> None:
    shedder = SloShedder(TierTable())
    overloaded = {0: 2000, 1: 10_000}  # premium wait 2 s, threshold 0.4 s
    assert shedder.check(_stats(overloaded, premium_blocks=(120, 300)), "premium", 100) is None
    shed = shedder.check(_stats(overloaded, premium_blocks=(300, 300)), "premium", 100)
    assert shed is not None and shed.estimated_wait_s == pytest.approx(2.1)
    assert shed.retry_after_s == pytest.approx(2.1 - (0.4 - 0.1))
    # the standard backlog is not ahead of premium: a saturated reservation alone is no reason
    saturated = _stats({0: 100, 1: 90_000}, premium_blocks=(300, 300))
    assert shedder.check(saturated, "premium", 10) is None
    # no premium request in the engine: it holds none of its 30 % of the pool
    assert shedder.check(_stats({1: 90_000}), "premium", 10) is None


def test_a_tier_without_a_ttft_objective_is_never_shed() -> None:
    shedder = SloShedder(TierTable())
    assert shedder.is_exempt("batch") and not shedder.is_exempt("standard")
    assert shedder.check(_stats({0: 10**6, 1: 10**6, 2: 10**6}), "batch", 10_000) is None


def test_fcfs_counts_every_tier_ahead_and_no_rate_means_no_estimate() -> None:
    shedder = SloShedder(TierTable())
    assert shedder.check(_stats({1: 100, 2: 5000}), "standard", 10) is None
    fcfs = _stats({1: 100, 2: 5000}, priority_preemption=False)
    shed = shedder.check(fcfs, "standard", 10)
    assert shed is not None and shed.estimated_wait_s == pytest.approx(5.11)
    unmeasured = _stats({1: 10**6})
    unmeasured.prefill_tokens_per_s = None
    assert shedder.check(unmeasured, "standard", 10) is None


def _standard_tenants(
    pending: dict[str, int], weights: dict[str, float] | None = None
) -> SchedulerStats:
    """Only the standard tier has a backlog, split by tenant."""
    stats = _stats({1: sum(pending.values())})
    stats.tiers[1].pending_prefill_tokens_by_tenant = dict(pending)
    stats.tiers[1].weight_by_tenant = dict(weights or {})
    return stats


def test_the_tenant_over_its_share_is_shed_not_the_light_one_beside_it() -> None:
    shedder = SloShedder(TierTable(), ShedConfig(slo_fraction=0.8))  # standard: 1.6 s
    stats = _standard_tenants({"heavy": 5000, "light": 100})
    # light: its own 100 + this 200, and as much of heavy's backlog -> 600 tokens, 0.6 s
    assert estimate_queue_wait_s(stats, 1, 200, TenantShare("light")) == pytest.approx(0.6)
    assert shedder.check(stats, "standard", 200, TenantShare("light")) is None
    # heavy: all of its own 5000, and light's 100 -> 5.3 s
    shed = shedder.check(stats, "standard", 200, TenantShare("heavy"))
    assert shed is not None and shed.estimated_wait_s == pytest.approx(5.3)
    # A new tenant is in the light one's place; without a tenant the whole tier is ahead.
    assert shedder.check(stats, "standard", 200, TenantShare("new")) is None
    assert shedder.check(stats, "standard", 200) is not None
    # Weights scale the share: with weight 10, heavy gets 10x the service while light waits.
    weighted = _standard_tenants({"heavy": 5000, "light": 100}, {"heavy": 10.0, "light": 1.0})
    wait_s = estimate_queue_wait_s(weighted, 1, 200, TenantShare("light", 1.0))
    assert wait_s == pytest.approx((100 + 3000 + 200) / RATE)
    # Under FCFS there is no sharing: everything queued is ahead of everyone.
    fcfs = _standard_tenants({"heavy": 5000, "light": 100})
    fcfs.priority_preemption = False
    assert estimate_queue_wait_s(fcfs, 1, 200, TenantShare("light")) == pytest.approx(5.3)


def test_admitted_prompts_count_for_their_tenant_until_the_engine_shows_them() -> None:
    shedder = SloShedder(TierTable(), ShedConfig(slo_fraction=0.8))
    stats = _standard_tenants({"heavy": 1000})
    for _ in range(3):  # 1.2 s, 1.4 s, 1.6 s: within the 1.6 s threshold
        assert shedder.check(stats, "standard", 200, TenantShare("heavy")) is None
        shedder.admitted("standard", 200, "heavy")
    # heavy's 1000 + 600 unseen + 200 = 1.8 s; light still sees only its share of it
    assert shedder.check(stats, "standard", 200, TenantShare("heavy")) is not None
    assert shedder.check(stats, "standard", 200, TenantShare("light")) is None


def test_thresholds_follow_the_tier_table_and_config() -> None:
    shedder = SloShedder(TierTable().scaled(10.0), ShedConfig(slo_fraction=0.5))
    assert shedder.thresholds_s["premium"] == pytest.approx(2.5)
    assert shedder.thresholds_s["standard"] == pytest.approx(10.0)
    with pytest.raises(AdmissionConfigError):
        ShedConfig(slo_fraction=0)


def test_standard_is_shed_when_premium_arrivals_leave_too_little_to_drain_its_backlog() -> None:
    shedder = SloShedder(TierTable(), ShedConfig(slo_fraction=0.8))  # standard: 1.6 s
    stats = _stats({1: 1000})
    # 1000 + 200 tokens at the full 1000 tokens/s: 1.2 s, admitted
    assert shedder.check(stats, "standard", 200) is None
    # premium prompts arriving at 500 tokens/s are served first: 1200 / 500 = 2.4 s
    stats.arrivals = {0: Arrivals(5.0, 500.0)}
    shed = shedder.check(stats, "standard", 200)
    assert shed is not None and shed.estimated_wait_s == pytest.approx(2.4)
    # retry when its wait is its own prompt's time (200 / 500 = 0.4 s) under the threshold:
    # 1000 - 1.2 * 500 = 400 tokens left ahead, 1.2 s at 500/s
    assert shed.retry_after_s == pytest.approx(1.2)
    # premium itself is not slowed by its own arrivals, nor standard by batch's
    premium = _stats({0: 200}, premium_blocks=(300, 300))
    premium.arrivals = {0: Arrivals(9.0, 900.0), 1: Arrivals(9.0, 900.0)}
    assert shedder.check(premium, "premium", 100) is None  # 0.3 s of 0.4
    stats.arrivals = {2: Arrivals(100.0, 10_000.0)}
    assert shedder.check(stats, "standard", 200) is None


def test_short_prompts_are_shed_when_the_batch_has_no_place_for_them_in_time() -> None:
    shedder = SloShedder(TierTable(), ShedConfig(slo_fraction=0.8))  # standard: 1.6 s
    stats = _stats({1: 40 * 20})  # 40 waiting prompts of 20 tokens: 0.8 s of prefill
    stats.tiers[1].num_waiting = 40
    stats.tiers[1].num_running = 64
    stats.max_num_seqs = 64
    stats.finished_requests_per_s = 50.0
    # 41 requests for places freeing at 50/s: 0.82 s, admitted
    assert shedder.check(stats, "standard", 20) is None
    # premium taking 30 of those places a second leaves 20: 2.05 s
    stats.arrivals = {0: Arrivals(30.0, 100.0)}  # prefill alone: 820 / 900 tokens/s
    shed = shedder.check(stats, "standard", 20)
    assert shed is not None and shed.estimated_wait_s == pytest.approx(41 / 20)
    # until its wait is its own share under the threshold: no place is free, and one frees
    # up every 1/20 s (more than its 20-token prompt takes at 900 tokens/s)
    assert shed.retry_after_s == pytest.approx(41 / 20 - (1.6 - 1 / 20))
    # and the next shed request is promised one place later
    again = shedder.check(stats, "standard", 20)
    assert again is not None
    assert again.retry_after_s == pytest.approx(41 / 20 - 1.55 + 1 / 20, abs=0.01)
