"""Field checks: each bad value raises InvalidFieldError naming its field (no database)."""

from __future__ import annotations

import math

import pytest

from tenants import InvalidFieldError
from tenants.validation import (
    validate_cache_salt,
    validate_name,
    validate_quota,
    validate_tier,
    validate_weight,
)


@pytest.mark.parametrize("name", ["acme", "a", "team-7_x", "a" * 64])
def test_valid_names(name: str) -> None:
    assert validate_name(name) == name


@pytest.mark.parametrize("name", ["", "7up", "Acme", "a b", "a" * 65, 7, None, "ünï"])
def test_invalid_names(name: object) -> None:
    with pytest.raises(InvalidFieldError) as caught:
        validate_name(name)
    assert caught.value.param == "name"


def test_tier_must_be_known() -> None:
    assert validate_tier("batch", ("premium", "standard", "batch")) == "batch"
    assert validate_tier("gold", ("gold",)) == "gold"
    with pytest.raises(InvalidFieldError) as caught:
        validate_tier("gold", ("premium", "standard", "batch"))
    assert caught.value.param == "tier"
    assert "premium" in str(caught.value)


@pytest.mark.parametrize("weight", [0, -1, math.inf, math.nan, True, "2", None])
def test_invalid_weights(weight: object) -> None:
    with pytest.raises(InvalidFieldError) as caught:
        validate_weight(weight)
    assert caught.value.param == "weight"


def test_weight_accepts_ints_and_floats() -> None:
    assert validate_weight(2) == 2.0
    assert validate_weight(0.25) == 0.25


def test_cache_salt_length() -> None:
    assert validate_cache_salt("s") == "s"
    for bad in ["", "x" * 65, 3]:
        with pytest.raises(InvalidFieldError):
            validate_cache_salt(bad)


def test_quota_none_means_unlimited_and_values_pass_through() -> None:
    clean = validate_quota(
        {"requests_per_minute": 60, "kv_cap_share": 1, "tokens_per_minute": None}
    )
    assert clean == {"requests_per_minute": 60, "kv_cap_share": 1.0, "tokens_per_minute": None}


@pytest.mark.parametrize(
    ("field", "value"),
    [
        ("kv_cap_share", 0),
        ("kv_cap_share", 1.01),
        ("kv_cap_share", -0.5),
        ("kv_cap_share", "0.5"),
        ("requests_per_minute", -1),
        ("requests_per_minute", 1.5),
        ("requests_per_minute", True),
        ("requests_per_minute", 2**31),
        ("monthly_spend_budget_usd_micros", "100"),
        ("monthly_token_budget", 2**63),
        ("max_batch_size", 3),
    ],
)
def test_invalid_quota_values_name_the_field(field: str, value: object) -> None:
    with pytest.raises(InvalidFieldError) as caught:
        validate_quota({field: value})
    assert caught.value.param == f"quota.{field}"
