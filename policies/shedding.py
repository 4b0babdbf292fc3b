"""SLO-derived load shedding: refuse a request whose tier's queue wait would already miss.

A new request's wait (`policies.queue_wait.estimate_queue_wait_s`) is the longer of the time
until its prompt is computed (the prefill backlog ahead of it plus its own prompt, over the
engine's measured drain rate) and the time until it has a place in the batch (the requests
waiting ahead of it beyond the free places, over the rate requests leave the batch). Both
rates are less what the tiers above keep bringing in while it waits. On a decode-heavy load
the batch is what runs out: queued standard prompts waited for places several times as long
as their prefill backlog promised (ops/bench/journal.md, "Runs 12-15"). Ahead of it are the
tiers above and, inside its own tier, what fair sharing serves before it: the tenant's own
backlog and at most as much (weight-scaled) of each other tenant's. Under FCFS everything
queued is ahead and later arrivals behind. Over `slo_fraction` of the tier's TTFT objective
it is shed. So under overload the tenant sending more than its share is shed, not the light
one sharing its tier. Three things keep that estimate honest between the engine's snapshots
and keep the offered retry delay truthful:

- The engine publishes its statistics after each step, so requests admitted since then are
  not in them. A burst arriving within one step would all see the same backlog and all be
  let in. The shedder counts the requests it admitted itself until statistics come whose
  engine step took in requests after them.
- A prompt that alone takes longer than the threshold can never meet it; it is admitted when
  nothing is ahead of it rather than refused forever.
- `retry_after` is when the backlog ahead will have drained enough to admit the request with
  its own share to spare (plus one engine step, the age of the statistics): the time its
  prompt takes, or with no place free in the batch, the time one takes to free up. No two
  shed requests of a tier are promised the same moment: each promise moves the tier's next
  one on by its own share, so a herd told to come back is let in one after another rather
  than refused again all together.

Tiers without a TTFT objective (batch) are never shed here. A tier that holds a KV
reservation (premium) is shed only once the reservation is saturated: while it has reserved
blocks to spare its requests still get memory ahead of everyone else.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass

from engine import SchedulerStats
from policies.errors import AdmissionConfigError, Shed
from policies.queue_wait import (
    TenantShare,
    Unseen,
    estimate_queue_wait_s,
    free_places,
    place_service_rate,
    prefill_service_rate,
)
from policies.rate_limits import format_duration
from policies.tiers import Tier, TierTable


@dataclass(frozen=True)
class ShedConfig:
    # Share of the tier's TTFT SLO the estimated queue wait may reach. Below 1 because the
    # estimate ignores decode interference and p99 needs headroom over a typical wait.
    slo_fraction: float = 0.8
    min_retry_after_s: float = 0.1  # floor on the offered retry delay

    def __post_init__(self) -> None:
        if self.slo_fraction <= 0:
            raise AdmissionConfigError(f"slo_fraction must be positive, got {self.slo_fraction}")
        if self.min_retry_after_s < 0:
            raise AdmissionConfigError("min_retry_after_s must not be negative")


class SloShedder:
    """Shedding decisions over the tier table (thresholds computed once).

    Not thread-safe: one event loop calls check() and admitted().
    """

    def __init__(
        self,
        tiers: TierTable,
        config: ShedConfig | None = None,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._config = config or ShedConfig()
        self._tiers = tiers
        self._clock = clock  # seconds, monotonic: when promised retries fall due
        # tier -> queue wait threshold in seconds; None: never shed
        self.thresholds_s: dict[str, float | None] = {
            tier.name: None
            if tier.ttft_slo_s is None
            else tier.ttft_slo_s * self._config.slo_fraction
            for tier in tiers
        }
        self._unseen = _UnseenAdmissions()
        # (tier, tenant id) -> earliest moment not yet promised to a shed request of theirs
        self._next_retry_at_s: dict[tuple[str, str | None], float] = {}

    def is_exempt(self, tier_name: str) -> bool:
        """True for tiers never shed (no TTFT objective): no scheduler stats needed."""
        return self.thresholds_s[self._tiers[tier_name].name] is None

    def check(
        self,
        stats: SchedulerStats,
        tier_name: str,
        num_prompt_tokens: int,
        tenant: TenantShare | None = None,
    ) -> Shed | None:
        """The refusal for a new request of this tier (and tenant: None counts the tier's
        whole backlog as ahead) under the current backlog, or None."""
        tier = self._tiers[tier_name]
        threshold_s = self.thresholds_s[tier.name]
        if threshold_s is None:
            return None
        self._unseen.observe(stats, self._clock())
        wait_s = estimate_queue_wait_s(
            stats,
            tier.priority,
            num_prompt_tokens,
            tenant,
            Unseen(self._unseen.tokens, self._unseen.requests),
        )
        rate = prefill_service_rate(stats, tier.priority)
        own_s = num_prompt_tokens / rate if rate else 0.0
        if wait_s <= threshold_s or (own_s >= threshold_s and wait_s <= own_s):
            return None
        if _reservation_has_room(stats, tier):
            return None
        # What the request itself takes of the resource that binds: its prompt's time, or
        # with no place free in the batch, the time for one to free up.
        place_rate = place_service_rate(stats, tier.priority)
        place_s = 1 / place_rate if place_rate and not free_places(stats, tier.priority) else 0.0
        share_s = max(own_s, place_s)
        # How long until little enough is ahead of it to be admitted with its own share to
        # spare (promised the moment its estimate reaches the threshold, a retry is as likely
        # to find it just over as under, and such retries were refused again just over it:
        # ops/bench/journal.md, "Run 18"); a share of half the threshold or more: until
        # nothing is ahead. What is ahead drains at the rates the estimate divides by, so the
        # wait falls a second per second.
        drain_s = wait_s - max(threshold_s - share_s, share_s)
        retry_after_s = self._promise(
            (tier.name, None if tenant is None else tenant.tenant_id), drain_s, share_s, stats
        )
        return Shed(
            f"The server is overloaded for the {tier.name} tier: estimated queue wait "
            f"{format_duration(wait_s)}, over its {format_duration(threshold_s)} threshold. "
            f"Please retry after {format_duration(retry_after_s)}.",
            retry_after_s=retry_after_s,
            estimated_wait_s=wait_s,
            threshold_s=threshold_s,
        )

    def admitted(self, tier_name: str, num_prompt_tokens: int, tenant_id: str = "") -> None:
        """Count an admitted request's prompt until the engine's statistics show it."""
        priority = self._tiers[tier_name].priority
        self._unseen.add((priority, tenant_id), num_prompt_tokens, self._clock())

    def _promise(
        self, key: tuple[str, str | None], drain_s: float, share_s: float, stats: SchedulerStats
    ) -> float:
        """The retry delay for a request the backlog ahead fits in drain_s seconds from now;
        promises are spread per tier and tenant (key), share_s (its own share) apart."""
        now_s = self._clock()
        step_s = stats.mean_step_time_s or 0.0
        earliest_s = now_s + max(self._config.min_retry_after_s, drain_s + step_s)
        retry_at_s = max(earliest_s, self._next_retry_at_s.get(key, 0.0))
        self._next_retry_at_s[key] = retry_at_s + share_s
        return retry_at_s - now_s


# Longest an admission is counted, whatever the statistics say: admissions of tiers never
# shed are not followed by a check() that would read newer statistics, and must not pile up.
_MAX_UNSEEN_S = 10.0


class _UnseenAdmissions:
    """Prompt tokens admitted that the engine's latest statistics may not include yet.

    The engine loop takes new requests in before each step and publishes its statistics after
    it, with the moment it took them in (`SchedulerStats.taken_in_at_s`): an admission made
    before that moment is in them, one made after is not. (Counted instead until the
    statistics showed two more steps, or one more and the mean time of two, admissions made
    during a long prefill step were forgotten when that step's statistics came out, before
    the engine had them: the test of shedding then admitted 58 of 58 overload requests.)
    """

    def __init__(self) -> None:
        # (when admitted in seconds, (priority, tenant id), tokens)
        self._entries: deque[tuple[float, tuple[int, str], int]] = deque()
        # (priority, tenant id) -> prompt tokens and requests, summed over _entries
        self.tokens: dict[tuple[int, str], int] = {}
        self.requests: dict[tuple[int, str], int] = {}

    def observe(self, stats: SchedulerStats, now_s: float) -> None:
        taken_in_at_s = stats.taken_in_at_s
        if taken_in_at_s is not None:
            while self._entries and self._entries[0][0] <= taken_in_at_s:
                self._forget_oldest()
        self._forget_older_than(now_s - _MAX_UNSEEN_S)

    def add(self, key: tuple[int, str], num_tokens: int, now_s: float) -> None:
        self._forget_older_than(now_s - _MAX_UNSEEN_S)
        self._entries.append((now_s, key, num_tokens))
        self.tokens[key] = self.tokens.get(key, 0) + num_tokens
        self.requests[key] = self.requests.get(key, 0) + 1

    def _forget_older_than(self, admitted_at_s: float) -> None:
        while self._entries and self._entries[0][0] < admitted_at_s:
            self._forget_oldest()

    def _forget_oldest(self) -> None:
        _, key, num_tokens = self._entries.popleft()
        self.tokens[key] -= num_tokens
        self.requests[key] -= 1
        if not self.requests[key]:
            del self.tokens[key]
            del self.requests[key]


def _reservation_has_room(stats: SchedulerStats, tier: Tier) -> bool:
    """Whether the tier holds fewer KV blocks than are reserved for it."""
    tier_stats = stats.tiers.get(tier.priority)
    if tier_stats is not None:
        return tier_stats.num_kv_blocks < tier_stats.num_kv_blocks_reserved
    # no request of the tier in the engine: it holds nothing of its reservation
    return int(tier.kv_reserved_fraction * stats.num_kv_blocks_total) > 0
