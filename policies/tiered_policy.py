"""The tiered scheduling policy: tier priority with preemption, fair sharing inside a tier.

A request that cannot grow preempts, in order, the running requests of the least important
tier (most blocks, latest arrival first); within its own tier, the latest admitted. A waiting
request may preempt running requests of less important tiers to get in, never of a more
important tier; of its own tier only to restore fair sharing: when its tenant is light
(`policies.tier_shares`), it may preempt a request of a tenant over its share (least computed
first), and that tenant pays the recompute.

With fair sharing, a tier's prefills in progress are served in order of their tenant's
running requests per unit of weight, fewest first, and in the most important tier with work a
light tenant's prompt goes before the decodes; when such prompts leave budget over, the step
carries them alone (the under-share lane, at most one step in `under_share_lane_every_steps`).

Background tiers (the batch tier: `background_priority`) run in the capacity the others
leave: while a more important request runs or waits, a background prompt is computed only in
a step that carries no more important prompt, a capped chunk at a time, and at least once in
`background_prefill_every_steps` steps (a floor, so a batch never starves).
"""

from __future__ import annotations

from dataclasses import dataclass
from operator import attrgetter

from engine import AdmissionGate, Request, StepBuilder, Verdict, WaitingQueue
from policies.errors import PolicyError
from policies.fair_queue import TieredFairQueue
from policies.tenant_demand import TenantDemand
from policies.tier_shares import TierShares

_priority = attrgetter("priority")

# Tenants the under-share admission pass looks at per step, at most: it runs every step the
# queue is non-empty, and must not cost time in the number of waiting tenants.
_FAIR_SHARE_PROBES = 8


@dataclass(frozen=True)
class TieredPolicyConfig:
    # Inside a tier: a waiting request of a light tenant may preempt a request of a tenant
    # holding more than its share, so a light tenant does not wait for a heavy one's requests
    # to finish; light tenants' prompts go first (off: tiers only).
    fair_share: bool = True
    # With fair sharing: a step in which the prompts of light tenants (of the most important
    # tier with work) leave budget over carries nothing else; the rest waits one step, so a
    # light tenant's prompt does not run in, and pay for, a heavy tenant's full step. At most
    # one such step in this many (0: never), so nobody else waits more often.
    under_share_lane_every_steps: int = 4
    # Thrash guard: a request admitted fewer than this many steps ago is not preempted to
    # admit another request (growth pressure may still preempt it).
    preemption_min_run_steps: int = 4
    # Thrash guard: requests preempted this many times are the last victims of admission
    # preemption.
    max_preemptions_per_request: int = 3
    # Background work: requests of this priority or a less important one (the batch tier's)
    # run in the capacity the others leave. While a more important request runs or waits,
    # their prompts are computed only in steps that carry no more important prompt, at most
    # background_prefill_tokens of them a step; their decodes run as usual (None: no
    # background tier). A premium prompt then neither shares its step with a batch prompt
    # nor waits long behind one.
    background_priority: int | None = None
    background_prefill_tokens: int = 32
    # Starvation guard: background prompts get their capped share at least once in this many
    # steps, even while more important prompts arrive in every step.
    background_prefill_every_steps: int = 8

    def __post_init__(self) -> None:
        if self.under_share_lane_every_steps < 0:
            raise PolicyError("under_share_lane_every_steps must be >= 0")
        if self.background_prefill_tokens < 1 or self.background_prefill_every_steps < 1:
            raise PolicyError("the background prefill limits must be >= 1")
        if self.preemption_min_run_steps < 0 or self.max_preemptions_per_request < 0:
            raise PolicyError("the thrash guards must be >= 0")


class TieredPolicy:
    """waiting: the admission order (tiers, then tenants by virtual token counters)."""

    preempts_by_priority = True

    def __init__(
        self, waiting: WaitingQueue | None = None, config: TieredPolicyConfig | None = None
    ) -> None:
        self.waiting: WaitingQueue = waiting if waiting is not None else TieredFairQueue()
        self.config = config if config is not None else TieredPolicyConfig()
        self.demand = TenantDemand()  # prompts each tenant sent lately
        self.num_lane_steps = 0
        self._last_lane_step: int | None = None
        # the step from which background prompts have waited for more important ones
        self._background_held_since: int | None = None
        # this step's light senders by priority (`TenantDemand.light_senders`)
        self._light_senders: dict[int, frozenset[str]] = {}

    def record_sent(
        self, priority: int, tenant_id: str, weight: float, num_tokens: int, now_s: float
    ) -> None:
        self.demand.record(priority, tenant_id, weight, num_tokens, now_s)

    def build_step(self, step: StepBuilder, now_s: float) -> None:
        # Decodes first, then prefills in progress (more important tiers first), then
        # admissions. With fair sharing, in the most important tier that has work, the prompts
        # of light tenants (in progress, or waiting) go even before that tier's decodes: a
        # light tenant's long prompt takes the budget that a heavy tenant's decodes would
        # otherwise fill, step after step; when they leave budget over, the step may carry them
        # alone (`_takes_lane`). Below that tier a light tenant is still admitted before the
        # prefills in progress of its own and less important tiers, and inside every tier the
        # prefills in progress of the tenants holding the fewest running requests per unit of
        # weight go first.
        decodes: list[Request] = []
        prefills: list[Request] = []
        for request in step.running:
            (decodes if request.is_prefill_done else prefills).append(request)
        decodes.sort(key=_priority)
        prefills.sort(key=_priority)
        head = self.waiting.peek(set())
        # With work of a more important tier, background prompts go last and apart.
        background = self.config.background_priority
        if background is not None and not (
            (head is not None and head.priority < background)
            or any(r.priority < background for r in step.running)
        ):
            background = None
        background_prefills: list[Request] = []
        gate: AdmissionGate | None = None
        if background is not None:
            background_prefills = [r for r in prefills if r.priority >= background]
            prefills = [r for r in prefills if r.priority < background]
            gate = _ForegroundGate(background)
        # Only with background work held apart: an O(running) set not built every step.
        decode_ids = {r.request_id for r in decodes} if background is not None else set()
        if not self.config.fair_share:
            step.run(decodes)
            step.run(prefills)
            step.admit(gate)
            self._run_background(step, decode_ids, background_prefills, background)
            return
        self._light_senders = self.demand.light_senders(now_s)
        shares = TierShares.by_priority(step.running, self._light_senders)
        prefills.sort(key=lambda r: (r.priority, shares[r.priority].load(r.tenant_id)))
        best_waiting = float("inf") if head is None else head.priority
        first_tier = min(min(shares, default=float("inf")), best_waiting)
        if first_tier != float("inf"):
            step.run(
                r for r in prefills
                if r.priority == first_tier and shares[r.priority].is_light(r.tenant_id)
            )
            if best_waiting == first_tier:  # the under-share pass's tier: it runs here
                self._admit_under_share(step)
            if self._takes_lane(step):
                self._last_lane_step = step.num_steps
                self.num_lane_steps += 1
                return
        step.run(decodes)
        if best_waiting != first_tier:
            step.run(r for r in prefills if r.priority < best_waiting)
            if background is None or best_waiting < background:
                self._admit_under_share(step)
        step.run(prefills)
        step.admit(gate)
        self._run_background(step, decode_ids, background_prefills, background)

    def _run_background(
        self, step: StepBuilder, decode_ids: set[str], prefills: list[Request],
        background: int | None,
    ) -> None:
        """Background prompts (prefills in progress, then admissions) after the rest of the
        step, at most background_prefill_tokens of them, and only in a step that carries no
        more important prompt (every request scheduled so far was decoding) or after
        background_prefill_every_steps - 1 steps held back in a row. background None: no more
        important work, nothing held back."""
        if background is None:
            return
        head = self.waiting.peek(set())
        if not prefills and (head is None or head.priority < background):
            self._background_held_since = None  # no background prompt to hold back
            return
        if any(request_id not in decode_ids for request_id in step.scheduled):
            if self._background_held_since is None:
                self._background_held_since = step.num_steps
            num_held = step.num_steps - self._background_held_since
            if num_held < self.config.background_prefill_every_steps - 1:
                return
        budget = step.budget
        with step.capped(self.config.background_prefill_tokens):
            step.run(prefills)
            step.admit()
        if step.budget < budget:
            self._background_held_since = None

    def _admit_under_share(self, step: StepBuilder) -> None:
        # Nobody goes ahead of the running requests in a step where one of them could not
        # grow: the blocks given up go to them first. (Admitted ahead of the decodes, a light
        # tenant's prompt took the whole budget, could not grow in the next step, gave way,
        # and another of its prompts, or the same one, was admitted with the blocks it freed,
        # step after step: the decodes never ran. The property test found it twice.) After
        # them, waiting requests are admitted in queue order.
        if not step.short_of_blocks:
            step.admit(_UnderShareGate(step, self._light_senders))

    def _takes_lane(self, step: StepBuilder) -> bool:
        """Whether this step carries only the under-share prompts scheduled so far: they left
        budget over that other tenants' work would fill (a heavy tenant's decodes make the step
        cost several times what the light prompt costs alone: ops/bench/journal.md), and the
        previous lane step is at least `under_share_lane_every_steps` steps back."""
        every = self.config.under_share_lane_every_steps
        if not step.scheduled or step.budget == 0 or every == 0:
            return False
        if self._last_lane_step is not None and step.num_steps - self._last_lane_step < every:
            return False
        scheduled = step.scheduled
        lane_tenants = {r.tenant_id for r in step.running if r.request_id in scheduled}
        return self.waiting.peek(lane_tenants) is not None or any(
            r.tenant_id not in lane_tenants for r in step.running
        )

    def growth_victim(self, request: Request, candidates: list[Request], step: StepBuilder
                      ) -> Request:
        """A less important tier's request (most blocks, then latest arrival), else the latest
        admitted of request's own tier (possibly request itself). Never a more important tier."""
        own = request.priority
        candidates = [r for r in candidates if r.priority >= own]
        lowest = max(r.priority for r in candidates)
        if lowest > own:
            return max(
                (r for r in candidates if r.priority == lowest),
                key=lambda r: (step.blocks_held(r), r.arrival_time),
            )
        return max(candidates, key=lambda r: r.admission_seq)

    def admission_victims(self, request: Request, step: StepBuilder) -> list[Request]:
        """Less important tiers, least important first, then most blocks, then latest arrival;
        after them, requests of its own tier that fair sharing lets it take.

        Thrash guard: a request admitted fewer than preemption_min_run_steps steps ago is
        never a victim, so every resume makes progress; requests already preempted
        max_preemptions_per_request times go last.
        """
        guard_step = step.num_steps - self.config.preemption_min_run_steps
        candidates = [
            r
            for r in step.running
            if r.priority > request.priority and r.admitted_step <= guard_step
        ]
        limit = self.config.max_preemptions_per_request
        candidates.sort(
            key=lambda r: (
                r.num_preemptions < limit,
                r.priority,
                step.blocks_held(r),
                r.arrival_time,
            ),
            reverse=True,
        )
        return candidates + self._fair_share_victims(request, step, guard_step)

    def _fair_share_victims(
        self, request: Request, step: StepBuilder, guard_step: int
    ) -> list[Request]:
        """Requests of request's own tier it may preempt to restore fair sharing, cheapest
        recompute first: none unless its tenant is light (`TierShares.is_light_with`); then
        those of tenants that keep at least their share after giving one up."""
        if not self.config.fair_share:
            return []
        shares = TierShares.of(request.priority, step.running, self._light_senders)
        if not shares.is_light_with(request):
            return []
        limit = self.config.max_preemptions_per_request
        victims = [
            r
            for r in step.running
            if r.priority == request.priority
            and r.tenant_id != request.tenant_id
            and shares.num_running[r.tenant_id] - 1 >= shares.share(r.tenant_id, request)
            and r.admitted_step <= guard_step
        ]
        victims.sort(key=lambda r: (r.num_preemptions >= limit, r.num_computed_tokens))
        return victims

    def payer(self, victim: Request, request: Request) -> Request:
        """The more important tier that preempted the victim, or, for a fair-share preemption
        inside a tier, the over-share victim itself."""
        return victim if victim.priority == request.priority else request


class _ForegroundGate:
    """Admissions of tiers more important than the background priority only (the queue is in
    tier order: the first background request ends the pass)."""

    def __init__(self, background_priority: int) -> None:
        self._background_priority = background_priority

    def consider(self, request: Request) -> Verdict:
        return Verdict.STOP if request.priority >= self._background_priority else Verdict.ADMIT

    def admitted(self, request: Request) -> None:
        pass


class _UnderShareGate:
    """Admissions of light tenants (`TierShares.is_light_with`) of the most important waiting
    tier only, looking at no more than _FAIR_SHARE_PROBES tenants (a bounded cost per step)."""

    def __init__(self, step: StepBuilder, light_senders: dict[int, frozenset[str]]) -> None:
        self._step = step
        self._light_senders = light_senders
        self._priority: int | None = None
        self._num_probes = 0
        self._shares: TierShares | None = None  # of the pass's tier, until an admission

    def consider(self, request: Request) -> Verdict:
        if self._priority is None:
            self._priority = request.priority
        if request.priority != self._priority or self._num_probes == _FAIR_SHARE_PROBES:
            return Verdict.STOP  # never ahead of a more important tier's waiting requests
        self._num_probes += 1
        if self._shares is None:
            self._shares = TierShares.of(self._priority, self._step.running, self._light_senders)
        return Verdict.ADMIT if self._shares.is_light_with(request) else Verdict.PASS

    def admitted(self, request: Request) -> None:
        self._shares = None

