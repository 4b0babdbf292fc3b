"""Prices per tier, and the exact integer arithmetic that turns usage into micro-dollars.

Prices are data: the ``pricing`` section of the tiergate config file maps each tier to four
prices in US dollars; tiers it leaves out keep the defaults below. The defaults follow the
DESIGN tier multipliers (premium 3x, standard 1x, batch 0.5x) over these base prices:

    input (uncached prompt) tokens   $0.50 per million
    cached prompt tokens             $0.125 per million (a prefix-cache hit skips the compute)
    output tokens                    $1.50 per million
    GPU time                         $0.0004 per GPU-second (about $1.44 per GPU-hour)

Every price is a whole number of micro-dollars (1 USD = 1_000_000), so a charge is computed
exactly in integers: the sum lands in pico-dollars and is rounded half up to a micro-dollar
once per record. GPU time is counted in whole microseconds.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from decimal import Decimal, InvalidOperation

from billing.errors import InvalidSettingError, UnknownTierPriceError
from billing.records import UsageRecord

MICROS_PER_USD = 1_000_000
_MICROSECONDS_PER_SECOND = 1_000_000
_PICOS_PER_MICRO = 1_000_000
# The config keys of one tier's prices (US dollars), in TierPrice field order.
PRICE_KEYS = (
    "input_usd_per_million_tokens",
    "cached_input_usd_per_million_tokens",
    "output_usd_per_million_tokens",
    "usd_per_gpu_second",
)


@dataclass(frozen=True)
class TierPrice:
    """One tier's prices, in whole micro-dollars."""

    input_usd_micros_per_million: int  # per million prompt tokens not served from cache
    cached_input_usd_micros_per_million: int  # per million prompt tokens from the prefix cache
    output_usd_micros_per_million: int  # per million completion tokens
    usd_micros_per_gpu_second: int  # per GPU-second, own compute and recompute alike

    def __post_init__(self) -> None:
        for field in dataclasses.fields(self):
            if getattr(self, field.name) < 0:
                raise InvalidSettingError(f"{field.name} must not be negative", field.name)


DEFAULT_TIER_PRICES: Mapping[str, TierPrice] = {
    "premium": TierPrice(1_500_000, 375_000, 4_500_000, 1_200),
    "standard": TierPrice(500_000, 125_000, 1_500_000, 400),
    "batch": TierPrice(250_000, 62_500, 750_000, 200),
}


class Pricing:
    """Prices of every tier; prices records so the ledger stores what was charged."""

    def __init__(self, tier_prices: Mapping[str, TierPrice] = DEFAULT_TIER_PRICES) -> None:
        self._tier_prices = dict(tier_prices)

    @classmethod
    def from_mapping(cls, section: Mapping[str, object] | None) -> Pricing:
        """From the config file's ``pricing`` section: {tier: {PRICE_KEYS: usd}}.

        Tiers the section names replace their defaults and must give all four prices; a
        price is a non-negative number of US dollars, exact to the micro-dollar.
        """
        prices = dict(DEFAULT_TIER_PRICES)
        for tier, entry in (section or {}).items():
            param = f"pricing.{tier}"
            if not isinstance(entry, Mapping):
                raise InvalidSettingError(f"{param} must be a mapping of prices", param)
            unknown = set(entry) - set(PRICE_KEYS)
            if unknown:
                name = sorted(map(str, unknown))[0]
                raise InvalidSettingError(
                    f"unknown price {name!r}; expected: {', '.join(PRICE_KEYS)}",
                    f"{param}.{name}",
                )
            prices[str(tier)] = TierPrice(
                *(_usd_to_micros(entry.get(key), f"{param}.{key}") for key in PRICE_KEYS)
            )
        return cls(prices)

    @property
    def tiers(self) -> list[str]:
        return list(self._tier_prices)

    def for_tier(self, tier: str) -> TierPrice:
        price = self._tier_prices.get(tier)
        if price is None:
            raise UnknownTierPriceError(
                f"no price for tier {tier!r}; priced tiers: {', '.join(self._tier_prices)}"
            )
        return price

    def require_tiers(self, tiers: Collection[str]) -> None:
        """Raise unless every tier has a price (checked once at start-up)."""
        for tier in tiers:
            self.for_tier(tier)

    def charge_usd_micros(
        self,
        tier: str,
        *,
        num_prompt_tokens: int,
        num_cached_prompt_tokens: int,
        num_completion_tokens: int,
        gpu_seconds: float,
    ) -> int:
        """The tenant's charge for its own tokens and GPU time."""
        price = self.for_tier(tier)
        picos = (
            (num_prompt_tokens - num_cached_prompt_tokens) * price.input_usd_micros_per_million
            + num_cached_prompt_tokens * price.cached_input_usd_micros_per_million
            + num_completion_tokens * price.output_usd_micros_per_million
            # micro-dollars per million tokens x tokens = pico-dollars; so is us x micros/s.
            + _microseconds(gpu_seconds) * price.usd_micros_per_gpu_second
        )
        return _picos_to_micros(picos)

    def recompute_charge_usd_micros(self, tier: str, recompute_gpu_seconds: float) -> int:
        """The charge for recomputing a request of tier after it was preempted.

        Priced at the preempted request's tier: whoever caused the preemption pays what the
        preempted tenant would have paid for that GPU time, no more and no less.
        """
        price = self.for_tier(tier)
        return _picos_to_micros(
            _microseconds(recompute_gpu_seconds) * price.usd_micros_per_gpu_second
        )

    def price(self, record: UsageRecord) -> UsageRecord:
        """record with amount_usd_micros and recompute_amount_usd_micros set from its usage."""
        return dataclasses.replace(
            record,
            amount_usd_micros=self.charge_usd_micros(
                record.tier,
                num_prompt_tokens=record.num_prompt_tokens,
                num_cached_prompt_tokens=record.num_cached_prompt_tokens,
                num_completion_tokens=record.num_completion_tokens,
                gpu_seconds=record.gpu_seconds,
            ),
            recompute_amount_usd_micros=self.recompute_charge_usd_micros(
                record.tier, record.recompute_gpu_seconds
            ),
        )


def format_usd(usd_micros: int) -> str:
    """Exact decimal dollars, e.g. 1234567 -> "1.234567"."""
    sign = "-" if usd_micros < 0 else ""
    whole, fraction = divmod(abs(usd_micros), MICROS_PER_USD)
    return f"{sign}{whole}.{fraction:06d}"


def _usd_to_micros(value: object, param: str) -> int:
    if value is None:
        raise InvalidSettingError(f"{param} is missing", param)
    if isinstance(value, bool) or not isinstance(value, int | float | str):
        raise InvalidSettingError(f"{param} must be a number of US dollars", param)
    try:
        micros = Decimal(str(value)) * MICROS_PER_USD
    except InvalidOperation:
        raise InvalidSettingError(f"{param} must be a number of US dollars", param) from None
    if not micros.is_finite() or micros < 0:
        raise InvalidSettingError(f"{param} must be a non-negative number", param)
    if micros != micros.to_integral_value():
        raise InvalidSettingError(f"{param} must be a whole number of micro-dollars", param)
    return int(micros)


def _microseconds(seconds: float) -> int:
    return round(seconds * _MICROSECONDS_PER_SECOND)


def _picos_to_micros(picos: int) -> int:
    return (picos + _PICOS_PER_MICRO // 2) // _PICOS_PER_MICRO
