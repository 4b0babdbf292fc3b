"""TTFT paging logic: the sliding-window p99, rule configuration, the alert state machine."""

from __future__ import annotations

import random

import pytest

from policies import DEFAULT_TIERS, TierTable
from policies.alerts import (
    ALERT_NAME,
    AlertEvaluator,
    AlertEvent,
    AlertEventKind,
    AlertRuleError,
    AlertState,
    SlidingWindowQuantile,
    TtftAlertRule,
    rules_from_tiers,
)
from tests.manual_clock import ManualClock

# Where the tests' clocks start: a wall-clock time, as the alerts' timestamps are.
START_S = 1_700_000_000.0


def test_window_quantile_is_nearest_rank_and_forgets_old_samples() -> None:
    window = SlidingWindowQuantile(window_s=10.0)
    values = list(range(1, 101))
    random.Random(7).shuffle(values)
    for value in values:
        window.add(100.0, float(value))
    assert window.quantile(100.0, 0.99) == 99.0
    assert window.quantile(100.0, 0.5) == 50.0
    assert window.quantile(100.0, 1.0) == 100.0
    window.add(105.0, 1000.0)
    assert window.num_samples(109.9) == 101
    # At 110 the first hundred are exactly window_s old: out.
    assert window.num_samples(110.0) == 1
    assert window.quantile(110.0, 0.99) == 1000.0
    assert window.quantile(116.0, 0.99) is None


def test_window_memory_is_bounded() -> None:
    window = SlidingWindowQuantile(window_s=60.0, max_samples=50)
    for i in range(1000):
        window.add(0.0, float(i))
    assert window.num_samples(0.0) == 50
    assert window.quantile(0.0, 0.0) == 950.0  # the newest 50 are kept


def test_rules_default_to_the_tier_table_thresholds() -> None:
    rules = rules_from_tiers(DEFAULT_TIERS)
    assert [(r.tier, r.threshold_s) for r in rules] == [("premium", 0.4)]
    scaled = rules_from_tiers(TierTable().scaled(2.0))
    assert scaled[0].threshold_s == pytest.approx(0.8)


def test_rule_overrides_per_tier() -> None:
    rules = rules_from_tiers(
        DEFAULT_TIERS,
        {
            "premium": {"window_s": 120, "for_s": 30, "min_samples": 50},
            "standard": {"threshold_s": 1.5},
        },
    )
    assert rules == [
        TtftAlertRule("premium", 0.4, window_s=120, for_s=30, min_samples=50),
        TtftAlertRule("standard", 1.5),
    ]
    assert rules_from_tiers(DEFAULT_TIERS, {"premium": {"threshold_s": None}}) == []


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"gold": {"threshold_s": 1.0}}, "unknown tiers: gold"),
        ({"premium": {"threshold": 1.0}}, "unknown alert fields threshold"),
        ({"premium": {"threshold_s": 0}}, "threshold_s must be > 0"),
        ({"premium": {"window_s": -1}}, "window_s must be > 0"),
        ({"premium": {"for_s": -1}}, "for_s must be >= 0"),
        ({"premium": {"min_samples": 0}}, "min_samples must be >= 1"),
    ],
)
def test_bad_rule_config_raises(overrides: dict[str, dict[str, float]], message: str) -> None:
    with pytest.raises(AlertRuleError, match=message):
        rules_from_tiers(DEFAULT_TIERS, overrides)


def _evaluator(
    clock: ManualClock, window_s: float = 60.0, for_s: float = 10.0, min_samples: int = 20
) -> AlertEvaluator:
    rule = TtftAlertRule("premium", 0.4, window_s=window_s, for_s=for_s, min_samples=min_samples)
    return AlertEvaluator([rule], replica="gw-1", clock=clock)


def _traffic(
    evaluator: AlertEvaluator, clock: ManualClock, ttft_s: float, seconds: int
) -> list[AlertEvent]:
    """10 premium requests a second for `seconds`, evaluating every second."""
    events = []
    for _ in range(seconds):
        clock.now_s += 1.0
        for _ in range(10):
            evaluator.observe("premium", ttft_s)
            evaluator.observe("standard", 5.0)  # no rule: never alerts
        events += evaluator.evaluate()
    return events


def test_breach_fires_once_after_for_s_and_resolves_once() -> None:
    clock = ManualClock(START_S)
    evaluator = _evaluator(clock)
    assert _traffic(evaluator, clock, 0.1, 30) == []
    (status,) = evaluator.statuses()
    assert status.state is AlertState.INACTIVE and status.since_s is None
    assert status.value_s == pytest.approx(0.1)

    breach_start = clock.now_s
    events = _traffic(evaluator, clock, 0.9, 40)
    assert [e.kind for e in events] == [AlertEventKind.FIRE]
    fire = events[0]
    assert fire.name == ALERT_NAME and fire.tier == "premium"
    assert fire.dedup_key == "tiergate/gw-1/ttft_p99/premium"
    assert fire.value_s == pytest.approx(0.9) and fire.threshold_s == 0.4
    assert fire.ended_at_s is None
    # p99 goes over once more than 1 % of the window is slow (the first slow second),
    # then the breach must last for_s.
    assert fire.started_at_s == breach_start + 1 + 10
    assert evaluator.statuses()[0].state is AlertState.FIRING

    recovery_start = clock.now_s
    events = _traffic(evaluator, clock, 0.1, 120)
    assert [e.kind for e in events] == [AlertEventKind.RESOLVE]
    resolve = events[0]
    assert resolve.dedup_key == fire.dedup_key and resolve.started_at_s == fire.started_at_s
    # Resolves once fewer than 1 % of the window's samples are slow: the slow ones aged out.
    assert resolve.ended_at_s is not None
    assert recovery_start < resolve.ended_at_s <= recovery_start + 60
    (status,) = evaluator.statuses()
    assert status.state is AlertState.RESOLVED and status.since_s == resolve.ended_at_s
    assert evaluator.p99_s("standard") == 5.0


def test_short_breach_stays_pending_and_recovers_silently() -> None:
    clock = ManualClock(START_S)
    evaluator = _evaluator(clock, window_s=5.0, for_s=30.0)
    assert _traffic(evaluator, clock, 0.9, 10) == []
    assert evaluator.statuses()[0].state is AlertState.PENDING
    assert _traffic(evaluator, clock, 0.1, 10) == []
    assert evaluator.statuses()[0].state is AlertState.INACTIVE


def test_too_few_samples_never_breach_and_silence_resolves() -> None:
    clock = ManualClock(START_S)
    evaluator = _evaluator(clock, window_s=10.0, for_s=0.0, min_samples=20)
    for _ in range(19):
        evaluator.observe("premium", 3.0)
    assert evaluator.evaluate() == []
    evaluator.observe("premium", 3.0)
    (fire,) = evaluator.evaluate()  # for_s == 0: fires on the first breached evaluation
    assert fire.kind is AlertEventKind.FIRE and fire.num_samples == 20
    clock.now_s += 11.0  # traffic stopped: the window empties
    (resolve,) = evaluator.evaluate()
    assert resolve.kind is AlertEventKind.RESOLVE and resolve.value_s is None


def test_a_second_incident_fires_again_with_the_same_dedup_key() -> None:
    clock = ManualClock(START_S)
    evaluator = _evaluator(clock, window_s=5.0, for_s=2.0)
    kinds = []
    keys = set()
    for ttft_s in (0.9, 0.1, 0.9, 0.1):
        for event in _traffic(evaluator, clock, ttft_s, 15):
            kinds.append(event.kind)
            keys.add(event.dedup_key)
    assert kinds == [AlertEventKind.FIRE, AlertEventKind.RESOLVE] * 2
    assert keys == {"tiergate/gw-1/ttft_p99/premium"}


def test_one_rule_per_tier() -> None:
    rule = TtftAlertRule("premium", 0.4)
    with pytest.raises(AlertRuleError, match="one TTFT alert rule per tier"):
        AlertEvaluator([rule, rule], replica="r", clock=ManualClock(START_S))
