"""Iteration-level scheduling under one token budget, with preemption by recompute.

The mechanism only: each step, running requests and admissions take chunks of the token
budget in the order its policy (`engine.core.scheduling_policy`) gives; a request that cannot grow
takes the blocks of a running request the policy names, and a waiting request gets in when
places and blocks allow, if need be by preempting the requests the policy offers (all or
nothing). Prompts shared by samples are forked, prefix-cache hits skip computation, and the
step's output carries what the runner does not hold yet.

Adapter slots are a resource next to KV blocks: the running requests use at most `max_loras`
distinct adapters, so no step can hold more than the runner's slots. A waiting request on an
adapter without a slot takes one that is free, or the slot of an adapter whose running
requests are all less important (they are preempted), or waits; while it waits, no request
behind it on another adapter is admitted (base-model requests are), so the slots drain and
it gets one within the running requests' lifetimes, without being overtaken.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from engine.config import SchedulerConfig
from engine.core.forks import try_fork, undo_fork
from engine.core.kv_cache.kv_manager import ComputedBlocks, KVCacheManager
from engine.core.queues import WaitingQueue
from engine.core.rates import ArrivalRates, StepRates
from engine.core.request import Request, RequestStatus
from engine.core.runner_view import RunnerView
from engine.core.scheduler_stats import SchedulerStats, WaitingTotals, build_stats
from engine.core.scheduling_policy import AdmissionGate, SchedulingPolicy, Verdict
from engine.core.step_plan import StepPlan
from engine.core.stop_check import check_token_stop
from engine.scheduler_output import SchedulerOutput
from engine.types import ModelRunnerOutput


class Scheduler:
    def __init__(
        self,
        config: SchedulerConfig,
        kv_manager: KVCacheManager,
        policy: SchedulingPolicy,
        rates: StepRates | None = None,
        max_loras: int = 0,
    ) -> None:
        """max_loras: distinct adapters the running requests may use (the runner's slots)."""
        self.config = config
        self.max_loras = max_loras
        self.kv = kv_manager
        self.policy = policy
        self.rates = rates if rates is not None else StepRates()
        self.arrivals = ArrivalRates()  # prompts coming in, fed by the engine (it has the clock)
        self._waiting_totals = WaitingTotals()  # changed with self.waiting, in _wait/_unwait
        self.running: list[Request] = []
        self.requests: dict[str, Request] = {}
        self.num_steps = 0
        self._num_admissions = 0
        self._runner_view = RunnerView(kv_manager)
        self.num_preemptions_total = 0
        self._num_left_batch = 0  # running requests finished or aborted since record_step
        # prompt tokens admissions took off the backlog without computing them (prefix-cache
        # hits, forked prompts) since record_step
        self._num_reused_tokens = 0
        # the latest step's blocked class (StepPlan.blocked_priority)
        self.blocked_priority: int | None = None

    @property
    def waiting(self) -> WaitingQueue:
        return self.policy.waiting

    # -- requests in and out -------------------------------------------------------------------

    def add_request(self, request: Request) -> None:
        assert request.request_id not in self.requests, "duplicate request id"
        self.requests[request.request_id] = request
        request.status = RequestStatus.WAITING
        self._wait(request)

    def _wait(self, request: Request, *, at_head: bool = False) -> None:
        """Into the waiting queue (at the head of its class: a preempted request)."""
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
        self._runner_view.leave(request_id)
        return request

    def has_unfinished_requests(self) -> bool:
        return bool(self.requests)

    # -- one step ------------------------------------------------------------------------------

    def schedule(self, now_s: float) -> SchedulerOutput:
        """The next step's batch; now_s: the engine's clock (the policy may read it)."""
        plan = StepPlan(
            self.config.max_num_batched_tokens,
            self.running,
            self.num_steps,
            self.kv,
            self._schedule_running_all,
            self._schedule_waiting,
        )
        self.policy.build_step(plan, now_s)
        return self._build_output(plan)

    def _schedule_running_all(self, requests: Iterable[Request], plan: StepPlan) -> None:
        scheduled = plan.num_new_tokens
        running = RequestStatus.RUNNING
        max_model_len = self.config.max_model_len
        for request in requests:
            if plan.budget == 0:
                return
            if request.status is not running or request.request_id in scheduled:
                continue  # preempted earlier in this step, or already scheduled
            if request.num_pending_tokens and request.ends_with_pending(max_model_len):
                continue  # its token in flight is its last (async scheduling)
            self._schedule_running(request, plan)

    def _schedule_running(self, request: Request, plan: StepPlan) -> None:
        num_new = min(request.num_uncomputed_tokens, plan.budget)
        if not self.kv.fits_in_place(request, num_new):
            while not self.kv.grow(request, num_new):
                plan.short_of_blocks = True
                candidates = self.kv.room_makers(request, num_new, self.running)
                victim = self.policy.growth_victim(request, candidates, plan)
                self._preempt(victim, plan, preempted_by=request)
                if victim is request:
                    return
        self._commit_chunk(request, num_new, plan)

    def _schedule_waiting(self, plan: StepPlan, gate: AdmissionGate | None) -> None:
        """Admit waiting requests in queue order while budget lasts; gate: which may go."""
        # Requests set aside for this pass take their tenant's later requests with them, so
        # a tenant's requests are admitted in its queue order.
        passed: set[str] = set()
        slots_short = False  # a request waits for an adapter slot: no adapter overtakes it
        while plan.budget > 0:
            request = self.waiting.peek(passed)
            if request is None:
                return
            if request.num_pending_tokens:
                # Preempted while its token was in flight (async scheduling): it resumes
                # once the token is back, with every token it has.
                passed.add(request.tenant_id)
                continue
            if gate is not None:
                verdict = gate.consider(request)
                if verdict is Verdict.STOP:
                    return
                if verdict is Verdict.PASS:
                    passed.add(request.tenant_id)
                    continue
            if len(self.running) >= self.config.max_num_seqs:
                victims = self.policy.admission_victims(request, plan)
                if not victims:
                    plan.block(request.priority)
                    return
                self._preempt(victims[0], plan, self.policy.payer(victims[0], request))
            if request.lora is not None and (slots_short or not self._adapter_slot(request, plan)):
                if not slots_short:
                    plan.block(request.priority)
                slots_short = True
                passed.add(request.tenant_id)
                continue
            if request.fork_parent is not None:
                parent_id = request.fork_parent.request_id
                ready = try_fork(self.kv, request, plan.num_new_tokens.get(parent_id, 0))
                if ready is None:
                    passed.add(request.tenant_id)
                    continue
            computed = ComputedBlocks()
            if self.kv.num_blocks_held(request.request_id) == 0:
                computed = self.kv.get_computed_blocks(request)
            num_uncomputed = request.num_tokens - request.num_computed_tokens - computed.num_tokens
            num_new = min(num_uncomputed, plan.budget)
            if self.kv.exceeds_tenant_cap(request, num_new, computed):
                undo_fork(self.kv, request)
                passed.add(request.tenant_id)
                continue
            if not self.kv.can_allocate(request, num_new, computed):
                if not self._preempt_to_admit(request, num_new, computed, plan):
                    undo_fork(self.kv, request)
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
            if gate is not None:
                gate.admitted(request)

    def _commit_chunk(self, request: Request, num_new: int, plan: StepPlan) -> None:
        plan.num_new_tokens[request.request_id] = num_new
        plan.budget -= num_new
        if request.fork_parent is not None:
            request.fork_parent = None
        if request.num_computed_tokens >= len(request.prompt_token_ids):
            request.num_computed_tokens += num_new  # past the prompt: no input service
            return
        # The queue's service counts prompt tokens once: recompute after preemption is free.
        start = max(request.num_computed_tokens, request.num_computed_high_water)
        num_input = max(
            0, min(request.num_computed_tokens + num_new, request.num_prompt_tokens) - start
        )
        request.num_computed_tokens += num_new
        if num_input:
            self.waiting.on_service(request, num_input, 0)

    def _adapter_slot(self, request: Request, plan: StepPlan) -> bool:
        """Whether request's adapter has a slot among the running requests' adapters: it
        has one already, one is free, or the running requests of an adapter all less
        important than request give theirs up (the adapter that loses the fewest computed
        tokens)."""
        assert request.lora is not None
        by_adapter: dict[str, list[Request]] = {}
        for running in self.running:
            if running.lora is not None:
                by_adapter.setdefault(running.lora.name, []).append(running)
        if request.lora.name in by_adapter or len(by_adapter) < self.max_loras:
            return True
        priority = request.priority
        yielding = [group for group in by_adapter.values()
                    if all(r.priority > priority for r in group)]
        if not yielding:
            return False
        victims = min(yielding, key=lambda group: sum(r.num_computed_tokens for r in group))
        for victim in victims:
            self._preempt(victim, plan, self.policy.payer(victim, request))
        return True

    # -- preemption ----------------------------------------------------------------------------

    def _preempt_to_admit(
        self, request: Request, num_new: int, computed: ComputedBlocks, plan: StepPlan
    ) -> bool:
        """Preempt the running requests the policy offers so request fits; all or nothing."""
        victims: list[Request] = []
        num_freed = num_refunded = 0
        for victim in self.policy.admission_victims(request, plan):
            victims.append(victim)
            num_freed += self.kv.num_exclusive_blocks(victim.request_id)
            num_refunded += plan.num_new_tokens.get(victim.request_id, 0)
            num_fit = min(num_new, plan.budget + num_refunded)
            if self.kv.can_allocate(request, num_fit, computed, num_freed):
                for chosen in victims:
                    self._preempt(chosen, plan, self.policy.payer(chosen, request))
                return self.kv.can_allocate(request, min(num_new, plan.budget), computed)
        return False

    def _preempt(self, victim: Request, plan: StepPlan, preempted_by: Request) -> None:
        """Free the victim's blocks, keep its tokens, requeue it at the head of its class."""
        refund = plan.num_new_tokens.pop(victim.request_id, 0)
        if refund:
            plan.budget += refund
            victim.num_computed_tokens -= refund
        self.running.remove(victim)
        self.kv.free(victim)
        self._runner_view.leave(victim.request_id)
        victim.status = RequestStatus.PREEMPTED
        victim.num_computed_high_water = max(
            victim.num_computed_high_water, victim.num_computed_tokens
        )
        victim.num_computed_tokens = 0
        victim.num_preemptions += 1
        # Who pays for the recompute; a request that gave way to its own growth pays itself.
        victim.preempted_by_tenant_id = preempted_by.tenant_id
        self.num_preemptions_total += 1
        self._wait(victim, at_head=True)

    # -- output --------------------------------------------------------------------------------

    def _build_output(self, plan: StepPlan) -> SchedulerOutput:
        self.blocked_priority = plan.blocked_priority
        output = self._runner_view.output(self.num_steps, self.running, plan.num_new_tokens)
        self.num_steps += 1
        return output

    def chunk_requests(self, scheduler_output: SchedulerOutput) -> list[Request]:
        """The requests of a step's chunks, in chunk order; taken when it is scheduled (by
        the time its output is back, some may have ended and left `requests`)."""
        requests = self.requests
        return [requests[c.request_id] for c in scheduler_output.chunks]

    def step_failed(self, scheduler_output: SchedulerOutput) -> None:
        self._runner_view.step_failed(scheduler_output)

    def update_from_output(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        now: float,
        requests: Sequence[Request],
        admissions: Sequence[int] | None = None,
    ) -> list[Request]:
        """Append sampled tokens and apply token-level stops; requests: the chunks' requests
        and admissions their admission_seq, taken when the step was scheduled (None: nothing
        was scheduled since, as without async scheduling). Returns the requests that got a
        token (finished ones included).

        Under async scheduling the next step was scheduled before this one's tokens came
        back: a request that ended since (aborted, or stopped by the previous step's token)
        drops its token, and one preempted since keeps it for its resumption (and, admitted
        again already, its new blocks hold nothing of this step)."""
        updated: list[Request] = []
        block_size = self.kv.block_size
        sampled_ids, sampled_tokens = runner_output.request_ids, runner_output.token_ids
        num_sampled = len(sampled_ids)
        row = 0  # the runner's rows follow the sampled chunks' order...
        by_id: dict[str, int] | None = None  # ...else (a runner of its own order) by id
        on_service = self.waiting.on_service
        max_model_len = self.config.max_model_len
        running = RequestStatus.RUNNING
        chunks = scheduler_output.chunks
        assert len(chunks) == len(requests)
        for index, chunk in enumerate(chunks):
            request = requests[index]
            status = request.status
            if status is not running and status.is_finished:
                continue
            start = chunk.start_pos
            end = start + chunk.num_tokens
            if (end // block_size > start // block_size and status is running
                    and (admissions is None or request.admission_seq == admissions[index])):
                self.kv.cache_full_blocks(request, end)  # the chunk filled a block
            if not chunk.needs_sample:
                continue
            request.num_pending_tokens -= 1
            if by_id is None and row < num_sampled and sampled_ids[row] == chunk.request_id:
                token_id: int | None = sampled_tokens[row]
                row += 1
            else:
                if by_id is None:
                    by_id = runner_output.sampled_token_ids
                token_id = by_id.get(chunk.request_id)
            if token_id is None:
                continue
            if status is running:
                request.output_token_ids.append(token_id)
            else:  # preempted: waiting, counted in the backlog by its tokens
                self._waiting_totals.remove(request)
                request.output_token_ids.append(token_id)
                self._waiting_totals.add(request)
            if request.first_token_time is None:
                request.first_token_time = now
            on_service(request, 0, 1)
            updated.append(request)
            stop = check_token_stop(request, max_model_len)
            if stop is not None:
                self.finish_request(request.request_id, stop)
                request.finish_time = now
        return updated

    def record_step(
        self, scheduler_output: SchedulerOutput, interval_s: float, blocked_priority: int | None
    ) -> None:
        """Feed a step into the rates the queue-wait estimates use; interval_s: the wall time
        it stands for (`LLMEngine._rate_interval_s`); blocked_priority: `blocked_priority` as
        the step was scheduled (under async scheduling, the next one is scheduled since)."""
        num_prefill = sum(c.num_tokens for c in scheduler_output.chunks if c.is_prefill)
        num_decode = scheduler_output.num_batched_tokens - num_prefill
        # A step whose admissions stopped for want of a place or KV blocks drained what those
        # allowed, not what the token budget does: the place estimate covers such waits.
        had_backlog = (num_prefill > 0 or len(self.waiting) > 0) and blocked_priority is None
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
            self.policy.preempts_by_priority,
        )

