"""OpenAI's service_tier onto the tier table: auto, each name and its alias, a tenant's plan
as the ceiling (downgraded or refused), names no tier answers to, and the table's checks."""

from __future__ import annotations

import dataclasses

import pytest

from policies import (
    DEFAULT_TIERS,
    AbovePlan,
    ServiceTierError,
    TierTable,
    TierTableError,
    served_tier,
)

TABLE = TierTable()


@pytest.mark.parametrize(("own", "asked", "served"), [
    ("standard", None, "standard"), ("standard", "auto", "standard"),
    ("standard", "default", "standard"), ("standard", "flex", "batch"),
    ("standard", "priority", "standard"), ("standard", "fast", "standard"),
    ("premium", "fast", "premium"), ("premium", "flex", "batch"),
    ("batch", "priority", "batch"), ("batch", "default", "batch"),
])
def test_a_tenant_gets_what_it_asks_for_up_to_its_plan(own: str, asked: str | None,
                                                       served: str) -> None:
    assert served_tier(TABLE, own, asked).name == served


def test_above_the_plan_is_refused_under_refuse() -> None:
    with pytest.raises(ServiceTierError, match="above your plan") as refused:
        served_tier(TABLE, "batch", "default", AbovePlan.REFUSE)
    assert refused.value.is_permission
    assert served_tier(TABLE, "premium", "default", AbovePlan.REFUSE).name == "standard"


def test_a_name_no_tier_answers_to_is_not_offered() -> None:
    with pytest.raises(ServiceTierError, match="it takes: auto, priority, default, flex") as no:
        served_tier(TABLE, "standard", "scale")
    assert not no.value.is_permission
    custom = TierTable([dataclasses.replace(t, service_tier=None) for t in DEFAULT_TIERS])
    assert served_tier(custom, "premium", None).name == "premium"
    with pytest.raises(ServiceTierError, match=r"it takes: auto$"):
        served_tier(custom, "premium", "flex")


def test_the_table_checks_its_service_tiers() -> None:
    premium, standard, batch = DEFAULT_TIERS
    with pytest.raises(TierTableError, match="two tiers answer to one service_tier"):
        TierTable([premium, dataclasses.replace(standard, service_tier="priority"), batch])
    with pytest.raises(TierTableError, match="service_tier must be one of"):
        TierTable([dataclasses.replace(premium, service_tier="fast"), standard, batch])
