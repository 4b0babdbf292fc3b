"""The tier table: tiers are data (defaults below, or a JSON/YAML file), not code paths."""

from __future__ import annotations

import json
from collections.abc import Iterator
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import yaml

from policies.errors import TierTableError, UnknownTierError


@dataclass(frozen=True)
class Tier:
    name: str
    priority: int  # lower is more important; a tier may preempt every less important one
    ttft_slo_s: float | None  # p99 time-to-first-token objective; None: no objective
    tpot_slo_s: float | None  # p99 time-per-output-token objective
    kv_reserved_fraction: float  # share of KV blocks only this tier (or a higher one) may use
    price_multiplier: float  # applied to the base prices by billing
    alert_ttft_p99_s: float | None  # pages when the windowed TTFT p99 goes over this
    # Whether its requests may send a raw Lark or GBNF grammar (guided_grammar,
    # structured_outputs.grammar), whose masks cost what the grammar makes them cost; JSON
    # schemas, regexes and choices are always allowed.
    raw_grammars: bool = True
    # The OpenAI `service_tier` a request sends to be served in this tier (policies.
    # service_tiers): one of SERVICE_TIER_NAMES, or None (not asked for by name).
    service_tier: str | None = None

    def may_preempt(self, other: Tier) -> bool:
        return self.priority < other.priority


# What a tier may answer to: OpenAI's service tiers but `auto` (the tenant's own tier).
SERVICE_TIER_NAMES = ("priority", "default", "flex", "scale")

DEFAULT_TIERS = (
    Tier("premium", 0, 0.5, 0.05, 0.30, 3.0, 0.4, service_tier="priority"),
    Tier("standard", 1, 2.0, 0.10, 0.0, 1.0, None, service_tier="default"),
    Tier("batch", 2, None, None, 0.0, 0.5, None, service_tier="flex"),
)


class TierTable:
    def __init__(self, tiers: tuple[Tier, ...] | list[Tier] = DEFAULT_TIERS) -> None:
        self._tiers = {t.name: t for t in sorted(tiers, key=lambda t: t.priority)}
        if len(self._tiers) != len(tiers):
            raise TierTableError("tier names must be unique")
        if len({t.priority for t in tiers}) != len(tiers):
            raise TierTableError("tier priorities must be unique")
        if sum(t.kv_reserved_fraction for t in tiers) > 1.0:
            raise TierTableError("KV reservations add up to more than the whole pool")
        named = [t.service_tier for t in tiers if t.service_tier is not None]
        if len(set(named)) != len(named):
            raise TierTableError("two tiers answer to one service_tier")
        for tier in tiers:
            if tier.service_tier is not None and tier.service_tier not in SERVICE_TIER_NAMES:
                raise TierTableError(f"tier {tier.name}: service_tier must be one of "
                                     f"{', '.join(SERVICE_TIER_NAMES)}")
            if not isinstance(tier.raw_grammars, bool):
                raise TierTableError(f"tier {tier.name}: raw_grammars must be true or false")
            if not 0.0 <= tier.kv_reserved_fraction <= 1.0:
                raise TierTableError(f"tier {tier.name}: kv_reserved_fraction out of [0, 1]")

    @classmethod
    def from_file(cls, path: Path) -> TierTable:
        """Load `tiers: [{name, priority, ttft_slo_s, ...}]` from JSON or YAML."""
        text = path.read_text()
        data: Any = json.loads(text) if path.suffix == ".json" else yaml.safe_load(text)
        try:
            return cls(tuple(Tier(**entry) for entry in data["tiers"]))
        except (KeyError, TypeError) as exc:
            raise TierTableError(f"{path}: {exc}") from exc

    def __getitem__(self, name: str) -> Tier:
        tier = self._tiers.get(name)
        if tier is None:
            raise UnknownTierError(f"unknown tier {name!r}; known: {', '.join(self._tiers)}")
        return tier

    def __iter__(self) -> Iterator[Tier]:
        return iter(self._tiers.values())

    @property
    def names(self) -> list[str]:
        return list(self._tiers)

    def by_service_tier(self, service_tier: str) -> Tier | None:
        """The tier that answers to an OpenAI service_tier, if one does."""
        return next((t for t in self._tiers.values() if t.service_tier == service_tier), None)

    def background_priority(self) -> int | None:
        """The priority from which tiers are background work (`TieredPolicyConfig`): the
        least important tiers that have no TTFT objective, below at least one that has.
        None when the least important tier has an objective or no tier has one."""
        background = None
        for tier in reversed(self._tiers.values()):
            if tier.ttft_slo_s is not None:
                return background
            background = tier.priority
        return None

    def reserved_fractions(self) -> dict[int, float]:
        """priority -> reserved share, the form engine.CacheConfig takes."""
        return {
            t.priority: t.kv_reserved_fraction
            for t in self._tiers.values()
            if t.kv_reserved_fraction > 0
        }

    def scaled(self, factor: float) -> TierTable:
        """The same table with every latency objective multiplied by factor (CPU runs)."""

        def scale(value: float | None) -> float | None:
            return None if value is None else value * factor

        return TierTable(
            tuple(
                replace(
                    t,
                    ttft_slo_s=scale(t.ttft_slo_s),
                    tpot_slo_s=scale(t.tpot_slo_s),
                    alert_ttft_p99_s=scale(t.alert_ttft_p99_s),
                )
                for t in self._tiers.values()
            )
        )
