"""LLMEngine: add requests, step (schedule, run, post-process), read outputs. Not thread-safe;
engine.async_engine runs it in a thread of the caller's process, engine.engine_process in a
process of its own."""

from __future__ import annotations

import concurrent.futures
import logging
import math
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Any

import numpy as np

from engine.config import EngineConfig
from engine.core.fcfs_policy import FCFSPolicy
from engine.core.kv_cache.block_hash import prefix_key
from engine.core.kv_cache.kv_manager import KVCacheManager
from engine.core.metering import split_step_time
from engine.core.request import Request, RequestStatus
from engine.core.request_limits import RequestLimits
from engine.core.scheduler import Scheduler
from engine.core.scheduler_stats import EngineCounters, SchedulerStats
from engine.core.scheduling_policy import SchedulingPolicy
from engine.errors import InvalidRequestError, RequestErrorCode, RequestFault, is_fatal
from engine.sampling_params import SamplingParams
from engine.scheduler_output import SchedulerOutput
from engine.step_outputs import OutputEnd, StepOutputs
from engine.structured_output.grammar_compiler import GrammarCompiler, GrammarResult
from engine.text.text_output import TextOutputState, Tokenizer
from engine.types import (
    LoraRequest,
    ModelRunner,
    ModelRunnerOutput,
    RequestMetrics,
    RunnerStep,
    TenantContext,
    TokenLogprobs,
)

logger = logging.getLogger(__name__)

# Longest the engine blocks on compiling grammars when it has nothing else to run (new
# commands wait at most this long for it).
GRAMMAR_WAIT_S = 0.005

# Outputs carry RequestMetrics only with the first token, the end, and every this many tokens
# between (a caller that stops waiting for an aborted request's end bills what it saw last).
METRICS_EVERY_TOKENS = 64

_FINISH_REASONS = {
    RequestStatus.FINISHED_STOPPED: "stop",
    RequestStatus.FINISHED_LENGTH: "length",
    RequestStatus.FINISHED_ABORTED: "abort",
    RequestStatus.FINISHED_ERROR: "error",
}


@dataclass(frozen=True)
class _Final:
    """A sample's last output, made when it ended; its metering is read when it is sent."""

    request: Request
    new_tokens: list[int]
    text: str
    end: OutputEnd
    logprobs: list[TokenLogprobs]


@dataclass(eq=False)
class _InFlight:
    """A step handed to the runner whose output the engine has not processed yet."""

    scheduler_output: SchedulerOutput
    requests: list[Request]  # its chunks' requests, as scheduled
    # their admission_seq then (a preemption since changes it); None without async scheduling
    admissions: list[int] | None
    high_water: dict[str, int]  # recompute marks as scheduled (a preemption since moves them)
    step: RunnerStep
    blocked_priority: int | None  # the scheduler's, as it scheduled the step
    started: float  # engine clock before execute
    queued: float  # engine clock when execute returned
    # Final outputs of its requests that ended meanwhile, held until its time is charged.
    held: list[_Final] = field(default_factory=list)
    _by_id: dict[str, Request] | None = None

    def computes_for(self, request: Request) -> bool:
        if self._by_id is None:
            self._by_id = {r.request_id: r for r in self.requests}
        return self._by_id.get(request.request_id) is request


@dataclass(slots=True)
class _Preparation:
    """What a request waits for before the scheduler takes it: its adapter (the FLOPs its
    update adds per token) and its grammar."""

    loading: concurrent.futures.Future[float] | None
    compiling: concurrent.futures.Future[GrammarResult] | None

    @property
    def futures(self) -> list[concurrent.futures.Future[Any]]:
        return [f for f in (self.loading, self.compiling) if f is not None]

    @property
    def is_done(self) -> bool:
        return all(f.done() for f in self.futures)


class LLMEngine:
    def __init__(
        self,
        config: EngineConfig,
        runner: ModelRunner,
        policy: SchedulingPolicy | None = None,
        tokenizer: Tokenizer | None = None,
        clock: Callable[[], float] = time.monotonic,
        grammars: GrammarCompiler | None = None,
    ) -> None:
        """policy: the scheduling policy (FCFS by default); grammars: compiles structured
        outputs (None: requests with one are refused)."""
        config.validate()
        self.config = config
        self.runner = runner
        self.tokenizer = tokenizer
        self.clock = clock
        num_blocks = runner.num_kv_blocks
        self.kv = KVCacheManager(
            num_blocks,
            config.cache.block_size,
            config.cache.enable_prefix_caching,
            config.cache.reserved_blocks(num_blocks),
        )
        # Reached only through its protocol; the scheduler holds the same object.
        self.policy: SchedulingPolicy = policy if policy is not None else FCFSPolicy()
        self.scheduler = Scheduler(
            config.scheduler, self.kv, self.policy, max_loras=config.lora.max_loras
        )
        self._groups: dict[str, list[Request]] = {}  # caller's id -> its samples
        self._text: dict[str, TextOutputState] = {}  # sample request id -> text state
        self._pending = StepOutputs()  # outputs made outside step() (aborts)
        self.grammars = grammars
        # Requests waiting for their adapter to load or their grammar to compile, outside the
        # scheduler (off the step's thread): caller's id -> what it waits for.
        self._preparing: dict[str, _Preparation] = {}
        self.counters = EngineCounters()
        # Async scheduling: the next step is scheduled and queued before the previous one's
        # output is processed (the step whose output is awaited is in _in_flight).
        self.async_scheduling = (runner.runs_ahead if config.async_scheduling is None
                                 else config.async_scheduling)
        self._in_flight: _InFlight | None = None
        self._last_step_end: float | None = None  # when the latest model step finished
        self._busy_since_last_step = False  # it left unfinished requests behind
        self.limits = RequestLimits(
            max_model_len=config.scheduler.max_model_len,
            block_size=config.cache.block_size,
            num_kv_blocks=num_blocks,
            reserved_blocks=dict(self.kv.reserved_blocks),
        )

    # -- requests ------------------------------------------------------------------------------

    def add_request(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        tenant: TenantContext | None = None,
        arrival_time: float | None = None,
        lora: LoraRequest | None = None,
    ) -> None:
        """Queue a request; n > 1 samples share the prompt's KV blocks. lora: the adapter it
        runs with. A request whose adapter is not loaded yet, or whose grammar is not
        compiled, waits outside the scheduler while the runner loads it (off the step's
        thread: a cold adapter costs the other requests nothing); one whose adapter or grammar
        fails ends with an error output."""
        tenant = tenant or TenantContext()
        if request_id in self._groups:
            raise InvalidRequestError(f"request id {request_id!r} is already in use")
        max_tokens = self.validate_request(prompt_token_ids, sampling_params, tenant)
        if sampling_params.stop and self.tokenizer is None:
            raise InvalidRequestError("stop strings need a tokenizer", param="stop")
        constraint = sampling_params.structured
        if constraint is not None and self.grammars is None:
            raise InvalidRequestError("this engine serves no structured outputs",
                                      param=constraint.param)
        loading = None
        if lora is not None:  # held by the runner until the request's group is forgotten
            loading = self.runner.prepare_lora(lora)
            if loading.done() and loading.exception() is not None:
                self.runner.release_lora(lora)
                raise InvalidRequestError(f"adapter {lora.name!r}: {loading.exception()}",
                                          param="model")
        arrival = self.clock() if arrival_time is None else arrival_time
        samples: list[Request] = []
        for index in range(sampling_params.n):
            samples.append(
                Request(
                    request_id=request_id if sampling_params.n == 1 else f"{request_id}#{index}",
                    prompt_token_ids=list(prompt_token_ids),
                    sampling_params=sampling_params,
                    arrival_time=arrival,
                    tenant_id=tenant.tenant_id,
                    tier=tenant.tier,
                    priority=tenant.priority,
                    weight=tenant.weight,
                    cache_salt=prefix_key(tenant.cache_salt, lora),
                    lora=lora,
                    kv_cap_blocks=tenant.kv_cap_blocks,
                    eos_token_id=self.config.eos_token_id,
                    max_tokens=max_tokens,
                    group_id=request_id,
                    sample_index=index,
                    fork_parent=samples[0] if index > 0 else None,
                )
            )
        self._groups[request_id] = samples
        # n samples share one prompt: it is prefilled once
        now = self.clock()
        self.scheduler.arrivals.record(tenant.priority, len(prompt_token_ids), now)
        self.policy.record_sent(
            tenant.priority, tenant.tenant_id, tenant.weight, len(prompt_token_ids), now
        )
        for sample in samples:
            if self.tokenizer is not None and sampling_params.detokenize:
                self._text[sample.request_id] = TextOutputState(
                    self.tokenizer, sample.prompt_token_ids, sampling_params
                )
        if constraint is None and loading is None:
            for sample in samples:
                self.scheduler.add_request(sample)
            return
        compiling = None
        if constraint is not None:
            assert self.grammars is not None
            compiling = self.grammars.compile(constraint, tenant.cache_salt)
        preparation = _Preparation(loading, compiling)
        if preparation.is_done:  # adapter and grammar from the caches: scheduled at once
            self._schedule_prepared(request_id, preparation, self._pending)
        else:  # the request waits; the steps go on
            self._preparing[request_id] = preparation

    def _admit_prepared(self, outputs: StepOutputs) -> None:
        """Requests whose adapter and grammar are ready go to the scheduler (waiting briefly
        for one when the engine has nothing else to do); those whose adapter or grammar
        failed end with an error."""
        if not self._preparing:
            return
        if not self.scheduler.has_unfinished_requests():
            futures = [f for p in self._preparing.values() for f in p.futures]
            concurrent.futures.wait(futures, timeout=GRAMMAR_WAIT_S,
                                    return_when=concurrent.futures.FIRST_COMPLETED)
        for request_id, preparation in list(self._preparing.items()):
            if preparation.is_done:
                del self._preparing[request_id]
                self._schedule_prepared(request_id, preparation, outputs)

    def _schedule_prepared(
        self, request_id: str, preparation: _Preparation, outputs: StepOutputs
    ) -> None:
        samples = self._groups[request_id]
        fault = None
        lora_flops, grammar = 0.0, None
        try:
            if preparation.loading is not None:
                lora_flops = preparation.loading.result()
        except ValueError as exc:  # the adapter cannot be served (unreadable, wrong shapes)
            fault = RequestFault(RequestErrorCode.ADAPTER_INVALID, f"adapter: {exc}")
        try:
            if fault is None and preparation.compiling is not None:
                grammar = preparation.compiling.result()
        except BaseException as exc:  # a GrammarError, or a native panic: this request only
            if is_fatal(exc):
                raise
            fault = RequestFault(RequestErrorCode.GRAMMAR_INVALID, f"grammar: {exc}")
        if fault is not None:
            for sample in samples:
                sample.status = RequestStatus.FINISHED_ERROR
            for sample in samples:
                self._error_output(sample, fault, outputs)
            return
        if grammar is not None:
            samples[0].grammar_compile_s = grammar.compile_time_s
        for sample in samples:
            sample.lora_flops_per_token = lora_flops
            if grammar is not None:
                sample.grammar = grammar.grammar
            self.scheduler.add_request(sample)

    def validate_request(
        self, prompt_token_ids: list[int], params: SamplingParams, tenant: TenantContext
    ) -> int:
        """Check the request can ever run; returns the resolved max_tokens."""
        return self.limits.validate(prompt_token_ids, params, tenant)

    def record_refused(self, num_prompt_tokens: int, tenant: TenantContext) -> None:
        """A request turned away for overload before it reached the engine: its tenant sent it
        all the same (a fair-sharing policy counts it: a heavy tenant mostly shed is still
        heavy)."""
        self.policy.record_sent(
            tenant.priority, tenant.tenant_id, tenant.weight, num_prompt_tokens, self.clock()
        )

    def abort(self, request_id: str) -> None:
        """End every sample of a request now (client gone); frees its blocks before the next
        step. Its final output (finish_reason "abort") comes with the next step()."""
        # A request still waiting for its adapter or grammar was never scheduled.
        unscheduled = self._preparing.pop(request_id, None) is not None
        for sample in self._groups.get(request_id, []):
            request: Request | None = sample
            if unscheduled:
                sample.status = RequestStatus.FINISHED_ABORTED
            else:
                request = self.scheduler.finish_request(
                    sample.request_id, RequestStatus.FINISHED_ABORTED
                )
            if request is not None:
                request.finish_time = self.clock()
                self._emit(self._pending, request, [], [], self._text.get(request.request_id))

    def has_unfinished_requests(self) -> bool:
        return (self.scheduler.has_unfinished_requests() or bool(self._pending)
                or bool(self._preparing) or self._in_flight is not None)

    def stats(self) -> SchedulerStats:
        """A snapshot: scheduler state and a copy of the engine's counters."""
        stats = self.scheduler.stats(self.clock())
        stats.counters = replace(self.counters)
        return stats

    @property
    def busy_time_s(self) -> float:
        """Measured step time since start; every second of it is charged to some request."""
        return self.counters.busy_time_s

    # -- the step ------------------------------------------------------------------------------

    def step(self) -> StepOutputs:
        """Schedule a step and run it. Under async scheduling the step is queued and the
        outputs returned are the previous step's (and a call with nothing left to schedule
        only finishes the step in flight)."""
        outputs, self._pending = self._pending, StepOutputs()
        self._admit_prepared(outputs)
        scheduler_output = self.scheduler.schedule(self.clock())
        self.counters.num_preemptions = self.scheduler.num_preemptions_total
        self.counters.num_lane_steps = self.policy.num_lane_steps
        queued = None
        if not scheduler_output.is_empty:
            queued = self._queue(scheduler_output, outputs)
        if not self.async_scheduling:
            if queued is not None:
                self._finish(queued, outputs)
            return outputs
        previous, self._in_flight = self._in_flight, queued
        if previous is not None:
            self._finish(previous, outputs)
        return outputs

    def finish_in_flight(self) -> StepOutputs:
        """Process the step in flight, if any (async scheduling): afterwards no step is
        queued, and async_scheduling may be switched."""
        flight, self._in_flight = self._in_flight, None
        outputs = StepOutputs()
        if flight is not None:
            self._finish(flight, outputs)
        return outputs

    def _queue(
        self, scheduler_output: SchedulerOutput, outputs: StepOutputs
    ) -> _InFlight | None:
        """Hand the step to the runner; a step that fails there fails its requests (their
        final outputs go to outputs) and returns None."""
        requests = self.scheduler.chunk_requests(scheduler_output)
        # only the requests ever preempted: the others recompute nothing
        high_water = {
            r.request_id: mark for r in requests if (mark := r.num_computed_high_water)
        }
        started = self.clock()
        try:
            step = self.runner.execute(scheduler_output)
        except BaseException as exc:  # a failed step (a native panic too) fails its requests
            if is_fatal(exc):
                raise
            self._step_failed(scheduler_output, requests, high_water, started, exc, outputs)
            return None
        admissions = [r.admission_seq for r in requests] if self.async_scheduling else None
        return _InFlight(scheduler_output, requests, admissions, high_water, step,
                         self.scheduler.blocked_priority, started, self.clock())

    def _finish(self, flight: _InFlight, outputs: StepOutputs) -> None:
        """Wait for a queued step's output, charge its time, process its tokens."""
        scheduler_output = flight.scheduler_output
        try:
            runner_output = flight.step.result()
            if not self.async_scheduling:
                self.runner.synchronize()  # the step's busy time ends when the device is done
        except BaseException as exc:
            if is_fatal(exc):
                raise
            self._step_failed(scheduler_output, flight.requests, flight.high_water,
                              flight.started, exc, outputs)
        else:
            now = self.clock()
            if not self.async_scheduling:
                step_time_s = now - flight.started
            elif runner_output.device_time_s is not None:
                step_time_s = runner_output.device_time_s
            else:  # the runner did the work in execute (CPU)
                step_time_s = flight.queued - flight.started
            self._meter(scheduler_output, flight.requests, flight.high_water, flight.started,
                        step_time_s, runner_output.grammar_seconds,
                        grammar_in_step=runner_output.device_time_s is None)
            self.scheduler.record_step(scheduler_output,
                                       self._rate_interval_s(flight.started, now),
                                       flight.blocked_priority)
            self._process(scheduler_output, runner_output, now, flight, outputs)
            self._busy_since_last_step = self.scheduler.has_unfinished_requests()
        for final in flight.held:  # charged now: their bills are complete
            self._add_final(final, outputs)

    def _step_failed(
        self,
        scheduler_output: SchedulerOutput,
        requests: list[Request],
        high_water: dict[str, int],
        started: float,
        exc: BaseException,
        outputs: StepOutputs,
    ) -> None:
        logger.error("engine step %d failed", scheduler_output.step_id, exc_info=exc)
        self.scheduler.step_failed(scheduler_output)
        self._meter(scheduler_output, requests, high_water, started,
                    max(self.clock() - started, 0.0), {}, failed=True)
        self._fail_step(scheduler_output, exc, outputs)

    def _rate_interval_s(self, started: float, now: float) -> float:
        """The wall time a step stands for in the measured rates: since the previous step
        ended, when the engine has had work ever since (what the loop does between steps,
        handing outputs over included, is part of what a step costs: left out, the finish rate
        read 5-20 % high on the CPU benchmark server), else the step alone (idle time is
        not)."""
        previous, self._last_step_end = self._last_step_end, now
        if previous is not None and self._busy_since_last_step:
            return now - previous
        return now - started

    def _meter(
        self,
        scheduler_output: SchedulerOutput,
        requests: list[Request],
        high_water: dict[str, int],
        started: float,
        step_time_s: float,
        grammar_seconds: dict[str, float],
        grammar_in_step: bool = True,
        failed: bool = False,
    ) -> None:
        """Charge the step's time to the requests in it (their final outputs wait for it):
        each constrained request its own grammar time (grammar_seconds), the rest by FLOPs.
        grammar_in_step: the step's time includes the grammar work (measured on the host);
        otherwise (a device's time) the grammar time is charged and counted on top."""
        chunks = scheduler_output.chunks
        if not chunks:
            return  # block copies only: nobody to charge, next to no time
        step_time_s = max(step_time_s, 0.0)
        grammar_s = 0.0
        if grammar_seconds:
            grammar_s = math.fsum(grammar_seconds.values())
            if grammar_in_step:
                grammar_s = min(grammar_s, step_time_s)
                step_time_s -= grammar_s
            self._charge_grammar(requests, grammar_seconds)
        adapter_flops = None
        if any(request.lora is not None for request in requests):
            adapter_flops = np.fromiter((r.lora_flops_per_token for r in requests), np.float64,
                                        len(requests))
        split = split_step_time(chunks, high_water, step_time_s, self.runner.estimate_flops,
                                adapter_flops)
        own, recompute, num_old = (split.gpu_seconds, split.recompute_gpu_seconds,
                                   split.num_recomputed_tokens)
        counters = self.counters
        for index, chunk in enumerate(chunks):  # per chunk of every step: kept lean
            request = requests[index]
            if request.first_scheduled_time is None:
                request.first_scheduled_time = started
            request.gpu_seconds += own[index]
            first_new = chunk.start_pos
            if num_old[index]:
                request.add_recompute(recompute[index], num_old[index])
                counters.recompute_time_s += recompute[index]
                counters.num_recomputed_tokens += num_old[index]
                first_new += num_old[index]
            num_prompt = len(request.prompt_token_ids)
            if first_new < num_prompt:  # new prompt tokens (a decode has none)
                counters.num_prompt_tokens += min(chunk.num_context_tokens, num_prompt) - first_new
        counters.num_steps += 1
        counters.num_failed_steps += int(failed)
        counters.busy_time_s += step_time_s + grammar_s
        counters.last_step_time_s = step_time_s + grammar_s

    @staticmethod
    def _charge_grammar(requests: list[Request], grammar_seconds: dict[str, float]) -> None:
        """Each constrained request's grammar time, on its bill and its budget."""
        for request in requests:
            seconds = grammar_seconds.get(request.request_id)
            if seconds is not None:
                request.gpu_seconds += seconds
                request.grammar_time_s += seconds

    def _process(
        self,
        scheduler_output: SchedulerOutput,
        runner_output: ModelRunnerOutput,
        now: float,
        flight: _InFlight,
        outputs: StepOutputs,
    ) -> None:
        updated = self.scheduler.update_from_output(scheduler_output, runner_output, now,
                                                    flight.requests, flight.admissions)
        self.counters.num_generated_tokens += len(updated)
        all_logprobs = runner_output.logprobs
        texts = self._text
        faults = (self._grammar_faults(updated, runner_output)
                  if runner_output.grammar_seconds or runner_output.grammar_faults else None)
        for request in updated:
            if faults and request.request_id in faults and not request.is_finished:
                self.scheduler.finish_request(request.request_id, RequestStatus.FINISHED_ERROR)
                request.finish_time = now
            new_tokens = request.output_token_ids[-1:]
            logprobs = all_logprobs.get(request.request_id) if all_logprobs else None
            text_state = texts.get(request.request_id) if texts else None
            if text_state is not None and not request.is_finished:
                # Stop strings end the request from here, across token boundaries.
                if text_state.append(new_tokens, finished=False):
                    self.scheduler.finish_request(
                        request.request_id, RequestStatus.FINISHED_STOPPED
                    )
                    request.stop_reason = text_state.stop_reason
                    request.finish_time = now
            elif text_state is not None:
                text_state.append(new_tokens, finished=True)
            fault = (faults.get(request.request_id)
                     if faults and request.status is RequestStatus.FINISHED_ERROR else None)
            self._emit(outputs, request, new_tokens, [logprobs] if logprobs else [], text_state,
                       fault)

    def _grammar_faults(
        self, updated: list[Request], runner_output: ModelRunnerOutput
    ) -> dict[str, RequestFault]:
        """The constrained requests that must end this step: their matcher failed, or their
        grammar is past its budget (`GrammarBudget`)."""
        faults = dict(runner_output.grammar_faults)
        seconds = runner_output.grammar_seconds
        budget = self.config.grammar_budget
        for request in updated:
            step_s = seconds.get(request.request_id)
            if step_s is None or request.request_id in faults:
                continue
            fault = budget.fault(step_s, request.grammar_time_s, len(request.output_token_ids))
            if fault is not None:
                logger.warning("a request's grammar is past its budget: %s", fault.message)
                faults[request.request_id] = fault
        return faults

    def _emit(
        self,
        outputs: StepOutputs,
        request: Request,
        new_tokens: list[int],
        logprobs: list[TokenLogprobs],
        text_state: TextOutputState | None,
        fault: RequestFault | None = None,
    ) -> None:
        """The request's output of this step, as a row of outputs. A finished request's last
        output waits, if a step computing for it is still in flight (async scheduling: it
        stopped a step late, or was aborted), until that step's time is charged, so that its
        bill holds every step it was in."""
        text = text_state.take_delta() if text_state is not None else ""
        num_outputs = len(request.output_token_ids)  # per running request per step: no hops
        if not request.status.is_finished:
            metrics = None
            if num_outputs == 1 or num_outputs % METRICS_EVERY_TOKENS == 0:
                metrics = self._metrics(request)
            outputs.add(request.group_id, request.sample_index, new_tokens, text,
                        len(request.prompt_token_ids), max(request.num_cached_tokens, 0),
                        num_outputs, None, metrics, logprobs)
            return
        end = OutputEnd(_FINISH_REASONS[request.status], request.stop_reason,
                        fault.message if fault is not None else None,
                        fault.code if fault is not None else None)
        self._forget(request)
        final = _Final(request, new_tokens, text, end, logprobs)
        flight = self._in_flight
        if flight is not None and flight.computes_for(request):
            flight.held.append(final)
        else:
            self._add_final(final, outputs)

    def _add_final(self, final: _Final, outputs: StepOutputs) -> None:
        request = final.request
        outputs.add(request.group_id, request.sample_index, final.new_tokens, final.text,
                    len(request.prompt_token_ids), max(request.num_cached_tokens, 0),
                    len(request.output_token_ids), final.end, self._metrics(request),
                    final.logprobs)

    def _fail_step(
        self, scheduler_output: SchedulerOutput, exc: BaseException, outputs: StepOutputs
    ) -> None:
        fault = RequestFault(RequestErrorCode.ENGINE_ERROR,
                             f"engine step failed: {type(exc).__name__}")
        for chunk in scheduler_output.chunks:
            request = self.scheduler.finish_request(chunk.request_id, RequestStatus.FINISHED_ERROR)
            if request is not None:
                self._error_output(request, fault, outputs)

    def _error_output(self, request: Request, fault: RequestFault, outputs: StepOutputs) -> None:
        """The final output of a request that ended in error (its status set already)."""
        request.finish_time = self.clock()
        self._emit(outputs, request, [], [], self._text.get(request.request_id), fault)

    @staticmethod
    def _metrics(request: Request) -> RequestMetrics:
        return RequestMetrics(
            arrival_time=request.arrival_time,
            first_scheduled_time=request.first_scheduled_time,
            first_token_time=request.first_token_time,
            finish_time=request.finish_time,
            num_preemptions=request.num_preemptions,
            preempted_by_tenant_id=request.preempted_by_tenant_id,
            gpu_seconds=request.gpu_seconds,
            recompute_gpu_seconds=request.recompute_gpu_seconds,
            num_recomputed_tokens=request.num_recomputed_tokens,
            recompute_charged_tenant_id=request.recompute_charged_tenant_id,
            recompute_gpu_seconds_by_tenant=dict(request.recompute_gpu_seconds_by_tenant),
            grammar_compile_s=request.grammar_compile_s,
            grammar_time_s=request.grammar_time_s,
        )

    def _forget(self, request: Request) -> None:
        self._text.pop(request.request_id, None)
        group = self._groups.get(request.group_id)
        if group is not None and all(s.is_finished for s in group):
            del self._groups[request.group_id]
            if request.lora is not None:  # the hold add_request took
                self.runner.release_lora(request.lora)
