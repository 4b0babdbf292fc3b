"""Prices per tier: exact integer micro-dollars, defaults, the config section, recompute."""

from __future__ import annotations

from typing import Any

import pytest

from billing import (
    DEFAULT_TIER_PRICES,
    InvalidSettingError,
    Pricing,
    TierPrice,
    UnknownTierPriceError,
    format_usd,
)
from tests.billing.factories import make_record


def test_defaults_follow_the_tier_multipliers() -> None:
    standard = DEFAULT_TIER_PRICES["standard"]
    for tier, multiplier in (("premium", 3), ("batch", 0.5)):
        price = DEFAULT_TIER_PRICES[tier]
        assert (
            price.input_usd_micros_per_million == standard.input_usd_micros_per_million * multiplier
        )
        assert price.usd_micros_per_gpu_second == standard.usd_micros_per_gpu_second * multiplier


def test_a_charge_is_exact_integer_arithmetic() -> None:
    pricing = Pricing({"t": TierPrice(500_000, 125_000, 1_500_000, 400)})
    # 68 uncached x 0.5 + 32 cached x 0.125 + 20 out x 1.5 (micro-dollars per token)
    # + 250_000 us x 400 micro-dollars per s = 34 + 4 + 30 + 100 = 168
    amount = pricing.charge_usd_micros(
        "t",
        num_prompt_tokens=100,
        num_cached_prompt_tokens=32,
        num_completion_tokens=20,
        gpu_seconds=0.25,
    )
    assert amount == 168
    # A million uncached input tokens cost exactly the per-million price.
    assert (
        pricing.charge_usd_micros(
            "t",
            num_prompt_tokens=1_000_000,
            num_cached_prompt_tokens=0,
            num_completion_tokens=0,
            gpu_seconds=0.0,
        )
        == 500_000
    )


def test_rounding_is_half_up_once_per_charge() -> None:
    pricing = Pricing({"t": TierPrice(500_000, 0, 0, 0)})
    one = pricing.charge_usd_micros(
        "t", num_prompt_tokens=1, num_cached_prompt_tokens=0, num_completion_tokens=0,
        gpu_seconds=0.0,
    )  # fmt: skip
    three = pricing.charge_usd_micros(
        "t", num_prompt_tokens=3, num_cached_prompt_tokens=0, num_completion_tokens=0,
        gpu_seconds=0.0,
    )  # fmt: skip
    assert (one, three) == (1, 2)  # 0.5 -> 1, 1.5 -> 2


def test_price_sets_both_amounts_and_recompute_uses_the_preempted_tier() -> None:
    pricing = Pricing()
    record = make_record(
        "r",
        tier="batch",
        amount_usd_micros=0,
        recompute_gpu_seconds=2.0,
        recompute_charged_tenant_id=9,
    )
    priced = pricing.price(record)
    assert (
        priced.recompute_amount_usd_micros
        == 2 * DEFAULT_TIER_PRICES["batch"].usd_micros_per_gpu_second
    )
    assert priced.amount_usd_micros == pricing.charge_usd_micros(
        "batch",
        num_prompt_tokens=100,
        num_cached_prompt_tokens=32,
        num_completion_tokens=20,
        gpu_seconds=0.25,
    )
    assert priced.amount_usd_micros > 0
    assert (priced.request_id, priced.num_prompt_tokens) == (record.request_id, 100)


def test_from_mapping_replaces_named_tiers_and_keeps_the_others() -> None:
    pricing = Pricing.from_mapping(
        {
            "premium": {
                "input_usd_per_million_tokens": 2,
                "cached_input_usd_per_million_tokens": "0.5",
                "output_usd_per_million_tokens": 8.25,
                "usd_per_gpu_second": 0.000347,
            },
            "enterprise": {
                "input_usd_per_million_tokens": 0,
                "cached_input_usd_per_million_tokens": 0,
                "output_usd_per_million_tokens": 0,
                "usd_per_gpu_second": 0,
            },
        }
    )
    assert pricing.for_tier("premium") == TierPrice(2_000_000, 500_000, 8_250_000, 347)
    assert pricing.for_tier("standard") == DEFAULT_TIER_PRICES["standard"]
    assert pricing.for_tier("enterprise") == TierPrice(0, 0, 0, 0)
    assert Pricing.from_mapping(None).tiers == ["premium", "standard", "batch"]


_FULL = {
    "input_usd_per_million_tokens": 1,
    "cached_input_usd_per_million_tokens": 1,
    "output_usd_per_million_tokens": 1,
}


@pytest.mark.parametrize(
    ("section", "param"),
    [
        ({"gold": "cheap"}, "pricing.gold"),
        ({"gold": _FULL}, "pricing.gold.usd_per_gpu_second"),
        ({"gold": {**_FULL, "usd_per_gpu_second": -1}}, "pricing.gold.usd_per_gpu_second"),
        ({"gold": {**_FULL, "usd_per_gpu_second": 1e-9}}, "pricing.gold.usd_per_gpu_second"),
        ({"gold": {**_FULL, "usd_per_gpu_second": True}}, "pricing.gold.usd_per_gpu_second"),
        ({"gold": {**_FULL, "usd_per_gpu_second": "NaN"}}, "pricing.gold.usd_per_gpu_second"),
        ({"gold": {**_FULL, "usd_per_gpu_second": "a lot"}}, "pricing.gold.usd_per_gpu_second"),
        ({"gold": {**_FULL, "usd_per_gpu_second": 1, "tip": 2}}, "pricing.gold.tip"),
    ],
)
def test_bad_config_names_the_field(section: dict[str, Any], param: str) -> None:
    with pytest.raises(InvalidSettingError) as caught:
        Pricing.from_mapping(section)
    assert caught.value.param == param


def test_unknown_tiers_are_reported() -> None:
    pricing = Pricing()
    pricing.require_tiers(["premium", "standard", "batch"])
    with pytest.raises(UnknownTierPriceError, match="gold"):
        pricing.require_tiers(["premium", "gold"])


def test_format_usd_is_exact() -> None:
    assert [format_usd(v) for v in (0, 1, 1_234_567, 10**15 + 1)] == [
        "0.000000",
        "0.000001",
        "1.234567",
        "1000000000.000001",
    ]
