"""Iteration-level scheduling under one token budget, tier priority and preemption by recompute.

Each step: running decodes first, then chunks of prefills in progress, then new admissions in
the waiting queue's order. A request that cannot grow preempts, in order, the running requests
of the least important tier (most blocks, latest arrival first); within its own tier, the
latest admitted. A waiting request may preempt running requests of less important tiers to
get in (when priority preemption is on), never of a more important tier; of its own tier only
to restore fair sharing: when its tenant is light, it may preempt a request of a tenant over
its share (least computed first), and that tenant pays the recompute. A tenant is light in a
tier when it holds under half its weighted share of the tier's running requests, or under its
whole share while it sends under half its weighted share of the tier's prompt tokens
(`engine.demand`). With fair sharing on, a tier's prefills in progress are served in order of
their tenant's running requests per unit of weight, fewest first, and in the most important
tier with work a light tenant's prompt goes before the decodes; when such prompts leave budget
over, the step carries them alone (the under-share lane, at most one step in
`under_share_lane_every_steps`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from operator import attrgetter

from engine.config import SchedulerConfig
from engine.demand import TenantDemand
from engine.kv_manager import ComputedBlocks, KVCacheManager
from engine.queues import WaitingQueue
from engine.rates import ArrivalRates, StepRates
from engine.request import Request, RequestStatus
from engine.runner import ModelRunnerOutput
from engine.scheduler_output import NewRequestData, ScheduledChunk, SchedulerOutput
from engine.scheduler_stats import SchedulerStats, WaitingTotals, build_stats
from engine.stop_check import check_token_stop

_priority = attrgetter("priority")


def _no_priority(_request: Request) -> int:
    return 0

# Tenants the under-share admission pass looks at per step, at most: it runs every step the
# queue is non-empty, and must not cost time in the number of waiting tenants.
_FAIR_SHARE_PROBES = 8


@dataclass
class _StepPlan:
    """Bookkeeping while one step is being built."""

    budget: int  # tokens left in this step
    num_new_tokens: dict[str, int] = field(default_factory=dict)  # request id -> chunk length
    preempted: list[Request] = field(default_factory=list)
    # A running request could not grow and a request gave up its blocks for it.
    short_of_blocks: bool = False
    # Most important tier whose waiting head found no place in the batch or no KV blocks.
    blocked_priority: int | None = None

    def block(self, priority: int) -> None:
        if self.blocked_priority is None or priority < self.blocked_priority:
            self.blocked_priority = priority


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        waiting: WaitingQueue,
        rates: StepRates | None = None,
    ) -> None:
        self.config = config
        self.kv = kv_manager
        self.waiting = waiting
        # Tiers only matter for preemption (and the order of the running) when priority
        # preemption is on.
        self._effective_priority: Callable[[Request], int] = (
            _priority if config.enable_priority_preemption else _no_priority
        )
        self.rates = rates if rates is not None else StepRates()
        self.arrivals = ArrivalRates()  # prompts coming in, fed by the engine (it has the clock)
        self.demand = TenantDemand()  # prompts each tenant sent, fed by the engine
        # this step's light senders by priority (`TenantDemand.light_senders`)
        self._light_senders: dict[int, frozenset[str]] = {}
        self._waiting_totals = WaitingTotals()  # changed with self.waiting, in _wait/_unwait
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self._num_admissions = 0
        self._in_runner: set[str] = set()  # requests the runner holds (it was sent their data)
        self._removed_ids: set[str] = set()  # held requests ended or preempted since the last step
        self.num_preemptions_total = 0
        self.num_lane_steps_total = 0  # steps the under-share lane took
        self._num_left_batch = 0  # running requests finished or aborted since record_step
        # prompt tokens admissions took off the backlog without computing them (prefix-cache
        # hits, forked prompts) since record_step
        self._num_reused_tokens = 0
        # the latest step's blocked tier (_StepPlan.blocked_priority)
        self.blocked_priority: int | None = None
        self._last_lane_step: int | None = None  # the latest under-share lane step

    # -- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, "duplicate request id"
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self._wait(request)

    def _wait(self, request: Request, *, at_head: bool = False) -> None:
        """Into the waiting queue (at the head of its tier: a preempted request)."""
        if at_head:
            self.waiting.prepend(request)
        else:
            self.waiting.add(request)
        self._waiting_totals.add(request)

    def _unwait(self, request: Request) -> None:
        self.waiting.remove(request)
        self._waiting_totals.remove(request)

    def finish_request(self, request_id: str, status: RequestStatus) -> Request | None:
        """End a request (abort, stop string, error); frees its blocks at once."""
        assert status.is_finished
        request = self.requests.pop(request_id, None)
        if request is None:
            return None
        if request.status == RequestStatus.RUNNING:
            self.running.remove(request)
            self._num_left_batch += 1
        elif request.status in (RequestStatus.WAITING, RequestStatus.PREEMPTED):
            self._unwait(request)
        request.status = status
        self.kv.free(request)
        self.kv.forget(request)
        self._leave_runner(request_id)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step ------------------------------------------------------------------------------

    def schedule(self, now_s: float) -> SchedulerOutput:
        """The next step's batch; now_s: the engine's clock (for what tenants sent lately)."""
        plan = _StepPlan(budget=self.config.max_num_batched_tokens)
        # Decodes first, then prefills in progress (more important tiers first), then
        # admissions. With fair sharing, in the most important tier that has work, the prompts
        # of light tenants (in progress, or waiting) go even before that tier's decodes: a
        # light tenant's long prompt takes the budget that a heavy tenant's decodes would
        # otherwise fill, step after step; when they leave budget over, the step may carry them
        # alone (`_takes_under_share_lane`). Below that tier a light tenant is still admitted
        # before the prefills in progress of its own and less important tiers, and inside every
        # tier the prefills in progress of the tenants holding the fewest running requests per
        # unit of weight go first.
        decodes: list[Request] = []
        prefills: list[Request] = []
        for request in self.running:
            (decodes if request.is_prefill_done else prefills).append(request)
        decodes.sort(key=self._effective_priority)
        prefills.sort(key=self._effective_priority)
        order = decodes + prefills
        if not self._fair_share_applies:
            self._schedule_running_all(decodes, plan)
            self._schedule_running_all(prefills, plan)
            self._schedule_waiting(plan)
            return self._build_output(plan)
        self._light_senders = self.demand.light_senders(now_s)
        shares = _TierShares.by_priority(self.running, self._light_senders)
        prefills.sort(key=lambda r: (r.priority, shares[r.priority].load(r.tenant_id)))
        best_waiting = self._best_waiting_priority()
        first_tier = min(min(shares, default=float("inf")), best_waiting)
        if first_tier != float("inf"):
            starved = [
                r for r in prefills
                if r.priority == first_tier and shares[r.priority].is_light(r.tenant_id)
            ]
            self._schedule_running_all(starved, plan)
            if best_waiting == first_tier:  # the under-share pass's tier: it runs here
                self._schedule_waiting(plan, under_share_only=True)
            if self._takes_under_share_lane(plan, order):
                self._last_lane_step = self.num_steps
                self.num_lane_steps_total += 1
                return self._build_output(plan)
        self._schedule_running_all(decodes, plan)
        if best_waiting != first_tier:
            self._schedule_running_all([r for r in prefills if r.priority < best_waiting], plan)
            self._schedule_waiting(plan, under_share_only=True)
        self._schedule_running_all(prefills, plan)
        self._schedule_waiting(plan)
        return self._build_output(plan)

    def _takes_under_share_lane(self, plan: _StepPlan, running: list[Request]) -> bool:
        """Whether this step carries only the under-share prompts scheduled so far: they left
        budget over that other tenants' work would fill (a heavy tenant's decodes make the step
        cost several times what the light prompt costs alone: ops/bench/README.md), and the
        previous lane step is at least `under_share_lane_every_steps` steps back."""
        every = self.config.under_share_lane_every_steps
        if not plan.num_new_tokens or plan.budget == 0 or every == 0:
            return False
        if self._last_lane_step is not None and self.num_steps - self._last_lane_step < every:
            return False
        lane_tenants = {self.requests[i].tenant_id for i in plan.num_new_tokens}
        return self.waiting.peek(lane_tenants) is not None or any(
            r.tenant_id not in lane_tenants
            for r in running
            if r.status == RequestStatus.RUNNING
        )

    def _schedule_running_all(self, requests: list[Request], plan: _StepPlan) -> None:
        scheduled = plan.num_new_tokens
        running = RequestStatus.RUNNING
        for request in requests:
            if plan.budget == 0:
                return
            if request.status is not running or request.request_id in scheduled:
                continue  # preempted earlier in this step, or already scheduled
            self._schedule_running(request, plan)

    def _best_waiting_priority(self) -> float:
        """Priority of the most important waiting request (inf: none waits)."""
        head = self.waiting.peek(set())
        return float("inf") if head is None else head.priority

    def _schedule_running(self, request: Request, plan: _StepPlan) -> None:
        num_new = min(request.num_uncomputed_tokens, plan.budget)
        if not self.kv.fits_in_place(request, num_new):
            while not self.kv.can_allocate(request, num_new):
                plan.short_of_blocks = True
                victim = self._growth_victim(request, num_new)
                self._preempt(victim, plan, preempted_by=request)
                if victim is request:
                    return
            self.kv.allocate(request, num_new)
        self._commit_chunk(request, num_new, plan)

    def _schedule_waiting(self, plan: _StepPlan, under_share_only: bool = False) -> None:
        """Admit waiting requests in queue order while budget lasts. under_share_only: only
        those of light tenants (`_TierShares.is_light_with`) of the most important waiting
        tier, looking at no more than _FAIR_SHARE_PROBES tenants (a bounded cost per step)."""
        if under_share_only and plan.short_of_blocks:
            # Nobody goes ahead of the running requests in a step where one of them could
            # not grow: the blocks given up go to them first. (Admitted ahead of the decodes,
            # a light tenant's prompt took the whole budget, could not grow in the next step,
            # gave way, and another of its prompts, or the same one, was admitted with the
            # blocks it freed, step after step: the decodes never ran. The property test
            # found it twice.) After them, waiting requests are admitted in queue order.
            return
        skip_tenants: set[str] = set()
        first_priority: int | None = None
        num_probes = 0
        shares: _TierShares | None = None  # of first_priority's tier, until an admission
        while plan.budget > 0:
            request = self.waiting.peek(skip_tenants)
            if request is None:
                return
            if under_share_only:
                if first_priority is None:
                    first_priority = request.priority
                if request.priority != first_priority or num_probes == _FAIR_SHARE_PROBES:
                    return  # never ahead of a more important tier's waiting requests
                num_probes += 1
                if shares is None:
                    shares = _TierShares.of(first_priority, self.running, self._light_senders)
                if not shares.is_light_with(request):
                    skip_tenants.add(request.tenant_id)
                    continue
            if len(self.running) >= self.config.max_num_seqs:
                victims = self._admission_victims(request)
                if not victims:
                    plan.block(request.priority)
                    return
                self._preempt(victims[0], plan, preempted_by=self._payer(victims[0], request))
            if request.fork_parent is not None:
                ready = self._try_fork(request, plan)
                if ready is None:
                    skip_tenants.add(request.tenant_id)
                    continue
            computed = ComputedBlocks()
            if self.kv.num_blocks_held(request.request_id) == 0:
                computed = self.kv.get_computed_blocks(request)
            num_uncomputed = request.num_tokens - request.num_computed_tokens - computed.num_tokens
            num_new = min(num_uncomputed, plan.budget)
            if self.kv.exceeds_tenant_cap(request, num_new, computed):
                self._undo_fork(request)
                skip_tenants.add(request.tenant_id)
                continue
            if not self.kv.can_allocate(request, num_new, computed):
                if not self._preempt_to_admit(request, num_new, computed, plan):
                    self._undo_fork(request)
                    plan.block(request.priority)
                    return  # the head cannot get in: nobody behind it may overtake
                num_new = min(num_new, plan.budget)
            self._unwait(request)
            # What the backlog held of it and this step does not compute: a fork's prompt, or
            # the prefix cache's blocks.
            self._num_reused_tokens += request.num_computed_tokens + computed.num_tokens
            self.kv.allocate(request, num_new, computed)
            if request.num_cached_tokens < 0:
                request.num_cached_tokens = computed.num_tokens
            request.status = RequestStatus.RUNNING
            request.admitted_step = self.num_steps
            request.admission_seq = self._num_admissions
            self._num_admissions += 1
            self.running.append(request)
            self._commit_chunk(request, num_new, plan)
            shares = None

    def _try_fork(self, child: Request, plan: _StepPlan) -> bool | None:
        """Share the prompt blocks of sample 0 with a later sample once they are computed.

        True: forked (one token left to compute). False: fall back to a normal prefill.
        None: sample 0 has not finished its prompt yet; wait.
        """
        parent = child.fork_parent
        assert parent is not None
        # The prompt's KV must have been written by an earlier step, not just scheduled.
        num_written = parent.num_computed_tokens - plan.num_new_tokens.get(parent.request_id, 0)
        if parent.status == RequestStatus.RUNNING and num_written >= parent.num_prompt_tokens:
            self.kv.fork(parent, child, parent.num_prompt_tokens)
            # Recompute the last prompt token in a private copy of its block to get logits.
            child.num_computed_tokens = child.num_prompt_tokens - 1
            return True
        if parent.status in (RequestStatus.WAITING, RequestStatus.RUNNING):
            return None
        child.fork_parent = None
        return False

    def _undo_fork(self, child: Request) -> None:
        if child.fork_parent is not None and self.kv.num_blocks_held(child.request_id):
            self.kv.free(child)
            child.num_computed_tokens = 0

    def _commit_chunk(self, request: Request, num_new: int, plan: _StepPlan) -> None:
        plan.num_new_tokens[request.request_id] = num_new
        plan.budget -= num_new
        if request.fork_parent is not None:
            request.fork_parent = None
        if request.num_computed_tokens >= request.num_prompt_tokens:
            request.num_computed_tokens += num_new  # past the prompt: no input service
            return
        # Fair-share service counts prompt tokens once: recompute after preemption is free.
        start = max(request.num_computed_tokens, request.num_computed_high_water)
        num_input = max(
            0, min(request.num_computed_tokens + num_new, request.num_prompt_tokens) - start
        )
        request.num_computed_tokens += num_new
        if num_input:
            self.waiting.on_service(request, num_input, 0)

    # -- preemption ----------------------------------------------------------------------------

    def _growth_victim(self, request: Request, num_new: int) -> Request:
        """Who gives up blocks so request can grow: a less important tier, else the latest
        admitted of its own tier (possibly request itself). Never a more important tier.
        Over its tenant's KV cap, only the tenant's own requests can make room."""
        own_priority = self._effective_priority(request)
        candidates = [r for r in self.running if self._effective_priority(r) >= own_priority]
        if self.kv.exceeds_tenant_cap(request, num_new):
            candidates = [r for r in candidates if r.tenant_id == request.tenant_id]
        lowest = max(self._effective_priority(r) for r in candidates)
        if lowest > own_priority:
            return max(
                (r for r in candidates if self._effective_priority(r) == lowest),
                key=lambda r: (self.kv.num_blocks_held(r.request_id), r.arrival_time),
            )
        return max(candidates, key=lambda r: r.admission_seq)

    def _preempt_to_admit(
        self, request: Request, num_new: int, computed: ComputedBlocks, plan: _StepPlan
    ) -> bool:
        """Preempt running requests of less important tiers so request fits; all or nothing."""
        victims: list[Request] = []
        num_freed = num_refunded = 0
        for victim in self._admission_victims(request):
            victims.append(victim)
            num_freed += self.kv.num_exclusive_blocks(victim.request_id)
            num_refunded += plan.num_new_tokens.get(victim.request_id, 0)
            num_fit = min(num_new, plan.budget + num_refunded)
            if self.kv.can_allocate(request, num_fit, computed, num_freed):
                for chosen in victims:
                    self._preempt(chosen, plan, preempted_by=self._payer(chosen, request))
                return self.kv.can_allocate(request, min(num_new, plan.budget), computed)
        return False

    def _admission_victims(self, request: Request) -> list[Request]:
        """Running requests a waiting request may preempt, best victim first: less important
        tiers, least important first, then most blocks, then latest arrival; after them,
        requests of its own tier that fair sharing lets it take (`_fair_share_victims`).

        Thrash guard: a request admitted fewer than preemption_min_run_steps steps ago is
        never a victim, so every resume makes progress; requests already preempted
        max_preemptions_per_request times go last.
        """
        if not self.config.enable_priority_preemption:
            return []
        guard_step = self.num_steps - self.config.preemption_min_run_steps
        candidates = [
            r
            for r in self.running
            if r.priority > request.priority and r.admitted_step <= guard_step
        ]
        limit = self.config.max_preemptions_per_request
        candidates.sort(
            key=lambda r: (
                r.num_preemptions < limit,
                r.priority,
                self.kv.num_blocks_held(r.request_id),
                r.arrival_time,
            ),
            reverse=True,
        )
        return candidates + self._fair_share_victims(request, guard_step)

    @property
    def _fair_share_applies(self) -> bool:
        config = self.config
        return config.enable_priority_preemption and config.enable_fair_share_preemption

    def _fair_share_victims(self, request: Request, guard_step: int) -> list[Request]:
        """Requests of request's own tier it may preempt to restore fair sharing, cheapest
        recompute first: none unless its tenant is light (`_TierShares.is_light_with`); then
        those of tenants that keep at least their share after giving one up."""
        if not self._fair_share_applies:
            return []
        shares = _TierShares.of(request.priority, self.running, self._light_senders)
        if not shares.is_light_with(request):
            return []
        limit = self.config.max_preemptions_per_request
        victims = [
            r
            for r in self.running
            if r.priority == request.priority
            and r.tenant_id != request.tenant_id
            and shares.num_running[r.tenant_id] - 1 >= shares.share(r.tenant_id, request)
            and r.admitted_step <= guard_step
        ]
        victims.sort(key=lambda r: (r.num_preemptions >= limit, r.num_computed_tokens))
        return victims

    @staticmethod
    def _payer(victim: Request, request: Request) -> Request:
        """Who is charged the victim's recompute: the more important tier that preempted it,
        or, for a fair-share preemption inside a tier, the over-share victim itself."""
        return victim if victim.priority == request.priority else request

    def _preempt(self, victim: Request, plan: _StepPlan, preempted_by: Request) -> None:
        """Free the victim's blocks, keep its tokens, requeue it at the head of its tier."""
        refund = plan.num_new_tokens.pop(victim.request_id, 0)
        if refund:
            plan.budget += refund
            victim.num_computed_tokens -= refund
        self.running.remove(victim)
        self.kv.free(victim)
        self._leave_runner(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_high_water = max(
            victim.num_computed_high_water, victim.num_computed_tokens
        )
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        # Who pays for the recompute; a request that gave way to its own growth pays itself.
        victim.preempted_by_tenant_id = preempted_by.tenant_id
        plan.preempted.append(victim)
        self.num_preemptions_total += 1
        self._wait(victim, at_head=True)

    # -- output --------------------------------------------------------------------------------

    def _build_output(self, plan: _StepPlan) -> SchedulerOutput:
        """The step's chunks, decodes first; what the runner does not hold yet goes with them
        (a request's data when it joins, the block-table entries changed since)."""
        self.blocked_priority = plan.blocked_priority
        decodes: list[ScheduledChunk] = []
        prefills: list[ScheduledChunk] = []
        new_requests: list[NewRequestData] = []
        in_runner = self._in_runner
        num_new_tokens = plan.num_new_tokens
        num_batched = 0
        for request in self.running:
            request_id = request.request_id
            num_new = num_new_tokens.get(request_id)
            if num_new is None:
                continue
            if request_id not in in_runner:
                in_runner.add(request_id)
                new_requests.append(self._new_request_data(request))
            end = request.num_computed_tokens
            needs_sample = end == request.num_tokens
            if num_new == 1 and request.is_prefill_done:
                decodes.append(ScheduledChunk(request_id, end - 1, 1, needs_sample, False))
            else:
                prefills.append(ScheduledChunk(request_id, end - num_new, num_new, needs_sample,
                                               True))
            num_batched += num_new
        # a joining request's whole table goes with its data
        joined = {r.request_id for r in new_requests}
        block_updates = {
            request_id: (first, self.kv.block_ids(request_id, first))
            for request_id, first in self.kv.take_changed_tables().items()
            if request_id in in_runner and request_id not in joined
        }
        output = SchedulerOutput(
            step_id=self.num_steps,
            chunks=decodes + prefills,
            num_batched_tokens=num_batched,
            new_requests=new_requests,
            block_updates=block_updates,
            blocks_to_copy=self.kv.take_pending_copies(),
        )
        if not output.is_empty:  # an empty step does not reach the runner: they wait for one
            output.removed_request_ids, self._removed_ids = self._removed_ids, set()
        self.num_steps += 1
        return output

    def _new_request_data(self, request: Request) -> NewRequestData:
        return NewRequestData(
            request_id=request.request_id,
            token_ids=request.all_token_ids,
            num_prompt_tokens=request.num_prompt_tokens,
            block_ids=self.kv.block_ids(request.request_id),
            sampling_params=request.sampling_params,
            eos_token_id=request.eos_token_id,
            sample_index=request.sample_index,
            grammar=request.grammar,
        )

    def step_failed(self, scheduler_output: SchedulerOutput) -> None:
        """A step that raised may not have reached the runner: what it should have dropped
        goes again with the next step (dropping is idempotent)."""
        self._removed_ids |= scheduler_output.removed_request_ids

    def _leave_runner(self, request_id: str) -> None:
        """The runner drops what it keeps of the request before the next step."""
        if request_id in self._in_runner:
            self._in_runner.remove(request_id)
            self._removed_ids.add(request_id)

    def update_from_output(
        self, scheduler_output: SchedulerOutput, runner_output: ModelRunnerOutput, now: float
    ) -> list[Request]:
        """Append sampled tokens and apply token-level stops; returns the requests that got a
        token (finished ones included)."""
        updated: list[Request] = []
        block_size = self.kv.block_size
        requests = self.requests
        sampled = runner_output.sampled_token_ids
        on_service = self.waiting.on_service
        max_model_len = self.config.max_model_len
        running = RequestStatus.RUNNING
        for chunk in scheduler_output.chunks:
            request = requests.get(chunk.request_id)
            if request is None or request.status is not running:
                continue
            start = chunk.start_pos
            if (start + chunk.num_tokens) // block_size > start // block_size:
                self.kv.cache_full_blocks(request)  # the chunk filled a block
            token_id = sampled.get(chunk.request_id)
            if token_id is None:
                continue
            request.output_token_ids.append(token_id)
            if request.first_token_time is None:
                request.first_token_time = now
            on_service(request, 0, 1)
            updated.append(request)
            status = check_token_stop(request, max_model_len)
            if status is not None:
                self.finish_request(request.request_id, status)
                request.finish_time = now
        return updated

    def record_step(self, scheduler_output: SchedulerOutput, interval_s: float) -> None:
        """Feed a step into the rates the queue-wait estimates use; interval_s: the wall time
        it stands for (`LLMEngine._rate_interval_s`)."""
        num_prefill = sum(c.num_tokens for c in scheduler_output.chunks if c.is_prefill)
        num_decode = scheduler_output.num_batched_tokens - num_prefill
        # A step whose admissions stopped for want of a place or KV blocks drained what those
        # allowed, not what the token budget does: the place estimate covers such waits.
        had_backlog = (num_prefill > 0 or len(self.waiting) > 0) and self.blocked_priority is None
        num_left, self._num_left_batch = self._num_left_batch, 0
        num_reused, self._num_reused_tokens = self._num_reused_tokens, 0
        self.rates.record(num_prefill + num_reused, num_decode, interval_s, had_backlog, num_left)

    def stats(self, now_s: float) -> SchedulerStats:
        return build_stats(
            self.running,
            self._waiting_totals,
            self.kv,
            self.rates,
            self.arrivals.rates(now_s),
            self.config.max_num_seqs,
            self.blocked_priority,
            self.config.enable_priority_preemption,
        )


@dataclass
class _TierShares:
    """Running requests per tenant of one tier, for weighted fair shares of them."""

    num_running: dict[str, int]
    weights: dict[str, float]
    num_in_tier: int
    total_weight: float
    light_senders: frozenset[str]  # tenants sending under half their share (engine.demand)

    @classmethod
    def by_priority(
        cls,
        running: list[Request],
        light_senders: dict[int, frozenset[str]],
        only: int | None = None,
    ) -> dict[int, _TierShares]:
        """The shares of every tier with running requests (or of tier `only`), in one pass."""
        tiers: dict[int, _TierShares] = {}
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
        cls, priority: int, running: list[Request], light_senders: dict[int, frozenset[str]]
    ) -> _TierShares:
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
