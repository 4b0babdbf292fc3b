"""ParseTimeBudget: each tenant's large bodies take at most their share of the event loop."""

from __future__ import annotations

import pytest

from policies import ParseTimeBudget, ParseTimeConfig, ParseTimeSpent, RefusalReason
from tests.manual_clock import ManualClock


def test_a_tenant_past_its_share_waits_for_it_to_refill_and_others_do_not() -> None:
    clock = ManualClock(100.0)
    budget = ParseTimeBudget(ParseTimeConfig(capacity_s=0.25, refill_per_s=0.1), clock)
    for _ in range(5):  # five 60 ms parses: the burst spent, 50 ms owed
        budget.check("heavy")
        budget.spend("heavy", 0.06)
    with pytest.raises(ParseTimeSpent) as refused:
        budget.check("heavy")
    assert refused.value.reason is RefusalReason.PARSE_TIME
    assert refused.value.retry_after_s == pytest.approx(0.5, abs=0.02)
    budget.check("light")  # another tenant's bucket is its own
    clock.now_s += 0.55
    budget.check("heavy")


def test_a_parse_longer_than_the_bucket_leaves_a_debt_to_wait_out() -> None:
    clock = ManualClock(100.0)
    budget = ParseTimeBudget(ParseTimeConfig(capacity_s=0.25, refill_per_s=0.1), clock)
    budget.spend("t", 0.45)  # the body was read already: 0.2 s of debt
    with pytest.raises(ParseTimeSpent) as refused:
        budget.check("t")
    assert refused.value.retry_after_s == pytest.approx(2.0, abs=0.02)
    clock.now_s += 2.05
    budget.check("t")


def test_the_tenants_remembered_stay_bounded() -> None:
    clock = ManualClock(100.0)
    budget = ParseTimeBudget(clock=clock)
    for index in range(ParseTimeBudget.MAX_TENANTS + 10):
        budget.spend(f"t{index}", 0.001)
        clock.now_s += 0.1  # each refills before the table is full
    assert len(budget._buckets) <= ParseTimeBudget.MAX_TENANTS
