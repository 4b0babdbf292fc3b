"""Weighted fair shares of one tier's places in the running batch, and who is light.

A tenant is light in a tier when it holds under half its weighted share of the tier's running
requests, or under its whole share while it sends under half its weighted share of the tier's
prompt tokens (`policies.tenant_demand`).
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass

from engine import Request


@dataclass
class TierShares:
    """Running requests per tenant of one tier, for weighted fair shares of them."""

    num_running: dict[str, int]
    weights: dict[str, float]
    num_in_tier: int
    total_weight: float
    light_senders: frozenset[str]  # tenants sending under half their share

    @classmethod
    def by_priority(
        cls,
        running: Sequence[Request],
        light_senders: dict[int, frozenset[str]],
        only: int | None = None,
    ) -> dict[int, TierShares]:
        """The shares of every tier with running requests (or of tier `only`), in one pass."""
        tiers: dict[int, TierShares] = {}
        for r in running:
            if only is not None and r.priority != only:
                continue
            shares = tiers.get(r.priority)
            if shares is None:
                shares = tiers[r.priority] = cls(
                    {}, {}, 0, 0.0, light_senders.get(r.priority, frozenset())
                )
            shares.num_running[r.tenant_id] = shares.num_running.get(r.tenant_id, 0) + 1
            shares.num_in_tier += 1
            if r.tenant_id not in shares.weights:
                shares.weights[r.tenant_id] = r.weight
                shares.total_weight += r.weight
        return tiers

    @classmethod
    def of(
        cls, priority: int, running: Sequence[Request], light_senders: dict[int, frozenset[str]]
    ) -> TierShares:
        return cls.by_priority(running, light_senders, only=priority).get(priority) or cls(
            {}, {}, 0, 0.0, light_senders.get(priority, frozenset())
        )

    def load(self, tenant_id: str) -> float:
        """Running requests a tenant holds in the tier per unit of its weight."""
        return self.num_running[tenant_id] / self.weights[tenant_id]

    def share(self, tenant_id: str, requester: Request) -> float:
        """tenant_id's share of the tier's running requests once requester's joins them."""
        total_weight = self.total_weight
        if requester.tenant_id not in self.weights:
            total_weight += requester.weight
        weight = requester.weight if tenant_id == requester.tenant_id else self.weights[tenant_id]
        return (self.num_in_tier + 1) * weight / total_weight

    def is_light(self, tenant_id: str) -> bool:
        """Whether a tenant with running requests in the tier is light: it holds under half
        its share, or under its share while it sends under half its share."""
        share = self.num_in_tier * self.weights[tenant_id] / self.total_weight
        return self._is_light(tenant_id, self.num_running[tenant_id], share)

    def is_light_with(self, request: Request) -> bool:
        """Whether request's tenant is light, its share counting request."""
        num_held = self.num_running.get(request.tenant_id, 0)
        return self._is_light(request.tenant_id, num_held, self.share(request.tenant_id, request))

    def _is_light(self, tenant_id: str, num_held: int, share: float) -> bool:
        limit = share if tenant_id in self.light_senders else share / 2
        return num_held < limit
