"""SLO shedding over fabricated scheduler statistics."""

from __future__ import annotations

import pytest

from engine import SchedulerStats, TierStats
from policies import AdmissionConfigError, RefusalReason, ShedConfig, SloShedder, TierTable

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
    assert shed.retry_after_s == pytest.approx(1.6)
    assert shed.should_retry
    assert "standard tier" in shed.message and "retry after 1.6s" in shed.message
    # retry_after is the time until it fits: the backlog drained for that long admits it
    assert shed.retry_after_s is not None
    drained_tokens = round(shed.retry_after_s * RATE)
    drained = _stats({0: 0, 1: 400 + 2600 - drained_tokens, 2: 50_000})
    assert shedder.check(drained, "standard", 200) is None
    almost = _stats({0: 0, 1: 400 + 2600 - drained_tokens + 10, 2: 50_000})
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
    assert shed.retry_after_s == pytest.approx(1.7)
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


def test_thresholds_follow_the_tier_table_and_config() -> None:
    shedder = SloShedder(TierTable().scaled(10.0), ShedConfig(slo_fraction=0.5))
    assert shedder.thresholds_s["premium"] == pytest.approx(2.5)
    assert shedder.thresholds_s["standard"] == pytest.approx(10.0)
    with pytest.raises(AdmissionConfigError):
        ShedConfig(slo_fraction=0)
