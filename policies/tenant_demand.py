"""What each tenant sends, per tier, over the last seconds: who is a light sender.

Fair sharing inside a tier counts places in the batch. A tenant sending a tenth of what
another sends gets few places by right of arrival, but each of its requests decodes slowly
beside the heavy tenant's full batch, so its requests pile up: on the CPU benchmark server the
light tenant's twelve slowest first tokens of run 30 all came while it held half its share of
places or more, so it could neither take a place from the heavy tenant nor put its prompt
before the heavy decodes (ops/bench/journal.md, "Run 30"). What a tenant sends, not only what
it holds, says whether it is light: a tenant sending under half its weighted share of its
tier's prompt tokens keeps those rights until it holds its whole share of places.

Demand counts every request the tenant sent, those the gateway shed for overload included:
a heavy tenant whose requests are mostly shed still sends heavily (counting only what got
in, the engine saw the light tenant's part of the tokens near the limit once the gateway
shed 59 % of the heavy tenant's requests).
Time is the engine's clock, passed in: tests drive it by hand.
"""

from __future__ import annotations

from collections import deque

# Seconds of requests the per-tenant demand is taken over.
_DEMAND_WINDOW_S = 5.0
# A tenant sending under this part of its weighted share of its tier's prompt tokens is light.
_LIGHT_SENDER_FRACTION = 0.5


class TenantDemand:
    """Prompt tokens sent per (priority, tenant) over a sliding window."""

    def __init__(self, window_s: float = _DEMAND_WINDOW_S) -> None:
        self._window_s = window_s
        # (seconds, priority, tenant id, prompt tokens)
        self._sent: deque[tuple[float, int, str, int]] = deque()
        self._tokens: dict[int, dict[str, int]] = {}  # priority -> tenant -> tokens in _sent
        self._num_sent: dict[tuple[int, str], int] = {}  # requests in _sent
        self._weights: dict[tuple[int, str], float] = {}  # latest weight of each sender

    def record(
        self, priority: int, tenant_id: str, weight: float, num_tokens: int, now_s: float
    ) -> None:
        """A request sent: admitted, or refused for overload."""
        self._forget_before(now_s - self._window_s)
        self._sent.append((now_s, priority, tenant_id, num_tokens))
        tier = self._tokens.setdefault(priority, {})
        tier[tenant_id] = tier.get(tenant_id, 0) + num_tokens
        key = (priority, tenant_id)
        self._num_sent[key] = self._num_sent.get(key, 0) + 1
        self._weights[key] = weight

    def sent(self, now_s: float) -> dict[int, dict[str, int]]:
        """Prompt tokens sent over the window, by priority and tenant."""
        self._forget_before(now_s - self._window_s)
        return {priority: dict(tier) for priority, tier in self._tokens.items()}

    def light_senders(self, now_s: float) -> dict[int, frozenset[str]]:
        """By priority, the tenants that sent under half their weighted share of the tier's
        prompt tokens over the window (a tier with one sender has none)."""
        self._forget_before(now_s - self._window_s)
        light: dict[int, frozenset[str]] = {}
        for priority, tier in self._tokens.items():
            if len(tier) < 2:
                continue
            weights = {t: self._weights[(priority, t)] for t in tier}
            # tokens per unit of weight under which a sender is light
            limit = _LIGHT_SENDER_FRACTION * sum(tier.values()) / sum(weights.values())
            light[priority] = frozenset(t for t, n in tier.items() if n < limit * weights[t])
        return light

    def _forget_before(self, cutoff_s: float) -> None:
        while self._sent and self._sent[0][0] < cutoff_s:
            _, priority, tenant_id, num_tokens = self._sent.popleft()
            tier = self._tokens[priority]
            tier[tenant_id] -= num_tokens
            key = (priority, tenant_id)
            self._num_sent[key] -= 1
            if not self._num_sent[key]:
                del tier[tenant_id], self._num_sent[key], self._weights[key]
                if not tier:
                    del self._tokens[priority]
