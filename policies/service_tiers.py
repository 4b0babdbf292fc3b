"""OpenAI's `service_tier`, asked per request, answered with tiergate's tiers.

`auto` (or none) is the tenant's own tier; `priority` (`fast` is its alias), `default`, `flex`
and `scale` are the tiers that answer to them in the tier table (by default premium, standard
and batch; none answers to `scale`). A tenant may ask for its own tier or any less important
one: it pays that tier's price and gets its priority. A more important tier than its plan's
is past what it bought: downgraded to its own tier (as OpenAI does when priority capacity is
not available), or refused, as the operator chooses.
"""

from __future__ import annotations

import enum

from policies.tiers import SERVICE_TIER_NAMES, Tier, TierTable

# The values a request may send (OpenAI's), and what aliases name.
REQUEST_SERVICE_TIERS = ("auto", *SERVICE_TIER_NAMES, "fast")
_ALIASES = {"fast": "priority"}


class AbovePlan(enum.StrEnum):
    """What becomes of a request asking for a tier more important than its tenant's."""

    DOWNGRADE = "downgrade"  # served in the tenant's own tier
    REFUSE = "refuse"  # refused (403)


class ServiceTierError(ValueError):
    """The service_tier cannot be served to this tenant; the message says why."""

    def __init__(self, message: str, *, is_permission: bool) -> None:
        super().__init__(message)
        self.is_permission = is_permission  # past the plan (403), else not offered (400)


def served_tier(tiers: TierTable, own_tier: str, asked: str | None,
                above_plan: AbovePlan = AbovePlan.DOWNGRADE) -> Tier:
    """The tier a request of a tenant in own_tier runs in, given the service_tier it asked
    for (None: auto). Raises ServiceTierError for a value no tier answers to, or one above
    the plan under AbovePlan.REFUSE."""
    own = tiers[own_tier]
    if asked is None or asked == "auto":
        return own
    name = _ALIASES.get(asked, asked)
    wanted = tiers.by_service_tier(name)
    if wanted is None:
        offered = ", ".join(["auto", *(t.service_tier for t in tiers if t.service_tier)])
        raise ServiceTierError(
            f"service_tier {asked!r} is not offered by this server; it takes: {offered}",
            is_permission=False)
    if not wanted.may_preempt(own):
        return wanted
    if above_plan is AbovePlan.REFUSE:
        raise ServiceTierError(
            f"service_tier {asked!r} is above your plan ({own.name}"
            + (f", service_tier {own.service_tier!r}" if own.service_tier else "")
            + "): ask for it or a lower one", is_permission=True)
    return own
