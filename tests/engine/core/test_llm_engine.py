"""LLMEngine behaviour around the scheduler: n > 1, aborts, failing steps, validation, stats."""

from __future__ import annotations

import asyncio
import contextlib
import time
from typing import Any

import pytest

from engine import (
    MAX_STOP_STRING_CHARS,
    ContextLengthExceededError,
    InvalidRequestError,
    ModelRunnerOutput,
    RequestOutput,
    SamplingParams,
    SchedulerOutput,
    TenantContext,
)
from engine.core.rates import Arrivals
from engine.process.async_engine import AsyncLLMEngine
from engine.testing.fake_runner import FakeModelRunner
from policies.queue_wait import (
    TenantShare,
    estimate_queue_wait_s,
    free_places,
    prefill_service_rate,
)
from tests.engine.helpers import make_engine, reference_output, run_to_completion, wrapped_engine
from tests.manual_clock import ManualClock

# Every test here runs with synchronous and with async scheduling.
pytestmark = pytest.mark.usefixtures("scheduling_mode")


def test_parallel_samples_share_prompt_blocks_and_stay_exact() -> None:
    engine = make_engine(num_blocks=64, block_size=4)
    prompt = list(range(10, 40))  # 30 tokens: 7 full blocks + a partial one
    engine.add_request("g", prompt, SamplingParams(n=3, max_tokens=5, ignore_eos=True))
    peak_shared = 0
    outputs: dict[int, list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            outputs.setdefault(out.sample_index, []).extend(out.new_token_ids)
        refs = [b.ref_cnt for b in engine.kv.pool.blocks]
        peak_shared = max(peak_shared, sum(1 for r in refs if r == 3))
    assert peak_shared >= 7, "the samples did not share the prompt's full blocks"
    # The fake model is deterministic (token = f(context)), so all samples agree.
    for tokens in outputs.values():
        assert tokens == reference_output(prompt, 5)
    assert engine.kv.num_free_blocks == engine.kv.num_blocks


def test_abort_frees_blocks_before_the_next_step() -> None:
    engine = make_engine(num_blocks=32, block_size=4)
    engine.add_request("a", list(range(10, 30)), SamplingParams(max_tokens=50, ignore_eos=True))
    engine.step()
    assert engine.kv.num_used_blocks > 0
    engine.abort("a")
    assert engine.kv.num_used_blocks == 0
    (final,) = engine.step()
    assert final.finished and final.finish_reason == "abort"


def test_a_failing_step_fails_its_requests_and_the_engine_goes_on() -> None:
    engine = make_engine(num_blocks=32, block_size=4)
    runner = engine.runner
    assert isinstance(runner, FakeModelRunner)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    runner.fail_next_step = True
    (failed,) = engine.step()
    assert failed.finish_reason == "error" and failed.error
    assert engine.kv.num_used_blocks == 0
    engine.add_request("b", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    assert run_to_completion(engine)[("b", 0)] == reference_output([5, 6, 7], 4)


class PanicException(BaseException):
    """What a Rust panic inside a native library surfaces as through pyo3 (a BaseException,
    which `except Exception` lets through)."""


def test_a_native_panic_in_a_step_fails_its_requests_and_the_engine_goes_on() -> None:
    engine = make_engine(num_blocks=32, block_size=4)
    runner = engine.runner
    assert isinstance(runner, FakeModelRunner)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    runner.fail_next_step = PanicException("called `Option::unwrap()` on a `None` value")
    (failed,) = engine.step()
    assert (failed.finish_reason, failed.error_code) == ("error", "engine_error")
    assert failed.error == "engine step failed: PanicException"
    assert engine.kv.num_used_blocks == 0
    engine.add_request("b", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    assert run_to_completion(engine)[("b", 0)] == reference_output([5, 6, 7], 4)


def test_an_interrupt_is_not_taken_for_a_failed_step() -> None:
    engine = make_engine(num_blocks=32, block_size=4)
    runner = engine.runner
    assert isinstance(runner, FakeModelRunner)
    engine.add_request("a", [5, 6, 7], SamplingParams(max_tokens=4, ignore_eos=True))
    runner.fail_next_step = KeyboardInterrupt()
    with pytest.raises(KeyboardInterrupt):
        engine.step()


def test_eos_and_stop_token_ids_end_a_request() -> None:
    engine = make_engine()
    prompt = [5, 6, 7]
    expected = reference_output(prompt, 6)
    engine.config.eos_token_id = expected[2]
    engine.add_request("eos", prompt, SamplingParams(max_tokens=6))
    engine.add_request("ignore", prompt, SamplingParams(max_tokens=6, ignore_eos=True))
    engine.add_request("min", prompt, SamplingParams(max_tokens=6, min_tokens=4, ignore_eos=False))
    engine.add_request(
        "stop", prompt, SamplingParams(max_tokens=6, stop_token_ids=[expected[1]], ignore_eos=True)
    )
    out = run_to_completion(engine)
    assert out[("eos", 0)] == expected[:3]
    assert out[("ignore", 0)] == expected
    assert len(out[("min", 0)]) == 6  # EOS at index 2 < min_tokens; nothing else stops it
    assert out[("stop", 0)] == expected[:2]


def test_invalid_requests_are_refused_with_the_param() -> None:
    engine = make_engine(num_blocks=8, block_size=4, max_model_len=64)
    with pytest.raises(InvalidRequestError) as err:
        engine.add_request("e", [], SamplingParams())
    assert err.value.param == "prompt"
    with pytest.raises(ContextLengthExceededError):
        engine.add_request("long", [5] * 60, SamplingParams(max_tokens=10))
    with pytest.raises(ContextLengthExceededError):  # fits the context, not the KV pool
        engine.add_request("big", [5] * 30, SamplingParams(max_tokens=30))
    with pytest.raises(InvalidRequestError) as err:
        SamplingParams(temperature=3.0)
    assert err.value.param == "temperature"
    SamplingParams(stop=["s" * MAX_STOP_STRING_CHARS])
    with pytest.raises(InvalidRequestError, match="at most 1024 characters") as err:
        SamplingParams(stop=["ok", "s" * (MAX_STOP_STRING_CHARS + 1)])
    assert err.value.param == "stop"
    engine.add_request("ok", [5], SamplingParams(max_tokens=2))
    with pytest.raises(InvalidRequestError):
        engine.add_request("ok", [5], SamplingParams(max_tokens=2))


@pytest.mark.step_by_step
def test_stats_show_a_full_batch_and_the_rate_places_free_up() -> None:
    engine = make_engine(max_num_batched_tokens=64, max_num_seqs=2)
    params = SamplingParams(max_tokens=3, ignore_eos=True)
    for i in range(6):
        engine.add_request(f"r{i}", [5] * 8, params)
    engine.step()  # two get the two places; the others wait for one
    stats = engine.stats()
    assert stats.blocked_priority == 1 and free_places(stats, 1) == 0
    assert stats.max_num_seqs == 2 and stats.finished_requests_per_s is None
    # the only step so far was held back by places: it says nothing of the prefill rate
    assert stats.prefill_tokens_per_s is None
    for _ in range(3):  # r0 and r1 finish at the third step, r2 and r3 take their places
        engine.step()
    stats = engine.stats()
    assert stats.finished_requests_per_s is not None and stats.finished_requests_per_s > 0
    # the place estimate: the two waiting and a new one behind them, no place free
    assert stats.tiers[1].num_waiting == 2 and stats.blocked_priority == 1
    assert estimate_queue_wait_s(stats, 1, 8) >= 3 / stats.finished_requests_per_s


@pytest.mark.step_by_step
def test_rates_count_the_loops_time_between_steps_but_not_idle_time() -> None:
    engine = make_engine()
    clock = ManualClock(100.0)
    engine.clock = clock
    execute = engine.runner.execute

    def slow_execute(output: SchedulerOutput) -> ModelRunnerOutput:
        clock.advance(0.02)  # the model step
        return execute(output)

    engine.runner.execute = slow_execute  # type: ignore[method-assign]
    params = SamplingParams(max_tokens=2, ignore_eos=True)
    engine.add_request("a", [5] * 8, params)
    engine.step()  # the first step: its own 20 ms
    clock.advance(0.03)  # the loop's work before the next step
    engine.step()  # "a" finishes: 50 ms since the step before
    assert engine.stats().mean_step_time_s == pytest.approx((0.02 + 0.05) / 2)
    clock.advance(10.0)  # idle: nothing to do
    engine.add_request("b", [6] * 8, params)
    engine.step()  # after idle time only the step counts
    assert engine.stats().mean_step_time_s == pytest.approx((0.02 + 0.05 + 0.02) / 3)


@pytest.mark.step_by_step
def test_the_drain_rate_counts_prompt_tokens_found_in_the_prefix_cache() -> None:
    """The backlog counts whole prompts, so the rate it drains at must too: a prompt found in
    the prefix cache leaves the backlog with its last block computed, not slowly."""
    engine = make_engine(block_size=4)
    clock = ManualClock(100.0)
    engine.clock = clock
    execute = engine.runner.execute

    def slow_execute(output: SchedulerOutput) -> ModelRunnerOutput:
        clock.advance(0.02)
        return execute(output)

    engine.runner.execute = slow_execute  # type: ignore[method-assign]
    prompt = list(range(10, 42))  # 32 tokens: 8 full blocks
    params = SamplingParams(max_tokens=1, ignore_eos=True)
    engine.add_request("a", prompt, params)
    engine.step()  # all 32 computed in 20 ms
    assert engine.stats().prefill_tokens_per_s == pytest.approx(32 / 0.02)
    engine.add_request("b", prompt, params)
    (out,) = engine.step()  # 28 of its tokens are cached, 4 computed, in 20 ms
    assert out.finished and out.num_cached_tokens == 28
    # 64 prompt tokens left the backlog in 40 ms (computed only: 36 in 40 ms)
    assert engine.stats().prefill_tokens_per_s == pytest.approx(64 / 0.04)


def test_stats_report_tiers_and_estimate_a_queue_wait() -> None:
    engine = make_engine(num_blocks=64, block_size=4, max_num_batched_tokens=16, max_num_seqs=2)
    premium = TenantContext(tenant_id="p", tier="premium", priority=0)
    for i in range(4):
        engine.add_request(f"s{i}", [5] * 40, SamplingParams(max_tokens=8, ignore_eos=True))
    engine.add_request("p0", [6] * 20, SamplingParams(max_tokens=8, ignore_eos=True), premium)
    for _ in range(3):
        engine.step()
    stats = engine.stats()
    assert stats.tiers[1].num_waiting >= 2 and stats.tiers[1].num_pending_prefill_tokens > 0
    assert stats.prefill_tokens_per_s is not None and stats.prefill_tokens_per_s > 0
    standard_wait = estimate_queue_wait_s(stats, 1, 40)
    premium_wait = estimate_queue_wait_s(stats, 0, 40)
    assert standard_wait > premium_wait > 0
    # Arrivals within the first second are counted over one second: 4 x 40 and 20 tokens.
    assert stats.arrivals == {1: Arrivals(4.0, 160.0), 0: Arrivals(1.0, 20.0)}
    # Standard is served with what premium's arrivals leave of the drain rate.
    assert prefill_service_rate(stats, 1) == pytest.approx(stats.prefill_tokens_per_s - 20.0)
    assert prefill_service_rate(stats, 0) == stats.prefill_tokens_per_s
    # Nobody has finished yet: no rate for places in the batch, the prefill wait is all.
    assert stats.finished_requests_per_s is None and stats.max_num_seqs == 2
    expected = (sum(t.num_pending_prefill_tokens for t in stats.tiers.values()) + 40) / (
        stats.prefill_tokens_per_s - 20.0
    )
    assert standard_wait == pytest.approx(expected)
    assert stats.tiers[1].num_waiting_by_tenant == {"default": stats.tiers[1].num_waiting}
    # The backlog is split by tenant (all of standard's is the default tenant's here).
    standard = stats.tiers[1]
    assert standard.pending_prefill_tokens_by_tenant == {
        "default": standard.num_pending_prefill_tokens
    }
    assert stats.tiers[0].pending_prefill_tokens_by_tenant.keys() <= {"p"}
    assert estimate_queue_wait_s(stats, 1, 40, TenantShare("default")) == pytest.approx(expected)


def test_async_engine_streams_outputs_and_aborts_on_early_exit() -> None:
    engine = make_engine(num_blocks=64, block_size=4, clock=time.monotonic)
    runner = engine.runner
    assert isinstance(runner, FakeModelRunner)
    runner.sleep = True  # real time, so the consumer can leave mid-stream
    async_engine = AsyncLLMEngine(engine)

    async def main() -> tuple[list[int], int]:
        tokens: list[int] = []
        async for out in async_engine.generate(
            "a", [5, 6, 7], SamplingParams(max_tokens=5, ignore_eos=True)
        ):
            tokens.extend(out.new_token_ids)
        num_seen = 0
        async for _ in async_engine.generate(
            "b", [5, 6, 8], SamplingParams(max_tokens=200, ignore_eos=True)
        ):
            num_seen += 1
            if num_seen == 3:
                break  # the client went away
        deadline_s = time.monotonic() + 10  # the abort lands at the engine's next step
        while engine.has_unfinished_requests() and time.monotonic() < deadline_s:
            await asyncio.sleep(0.01)
        return tokens, num_seen

    try:
        tokens, _ = asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert tokens == reference_output([5, 6, 7], 5)
    assert engine.kv.num_used_blocks == 0 and not engine.has_unfinished_requests()


def test_async_engine_statistics_say_when_their_step_took_requests_in() -> None:
    """The shedder counts its admissions until statistics whose step took in requests after
    them: a request submitted before that moment is in them."""
    engine = make_engine(num_blocks=64, block_size=4)
    async_engine = AsyncLLMEngine(engine)
    assert async_engine.stats().taken_in_at_s is None  # no step yet

    async def main() -> None:
        async for _ in async_engine.generate("a", [5, 6, 7], SamplingParams(max_tokens=2)):
            pass

    try:
        submitted_s = time.monotonic()
        asyncio.run(main())
        # The output can come before the statistics of its step; those of the engine run
        # dry come last.
        deadline = time.monotonic() + 5.0
        stats = async_engine.stats()
        while any(t.num_running for t in stats.tiers.values()) and time.monotonic() < deadline:
            time.sleep(0.001)
            stats = async_engine.stats()
    finally:
        async_engine.shutdown()
    assert stats.taken_in_at_s is not None
    assert submitted_s <= stats.taken_in_at_s <= time.monotonic()
    assert stats.counters.num_prompt_tokens == 3


def test_a_steps_outputs_wake_the_event_loop_once() -> None:
    """Each call into the event loop from the engine thread is a wake-up (a system call and a
    contest for the GIL): a step hands all its outputs over in one call, not one per output."""
    engine = make_engine(num_blocks=64, block_size=4)
    num_steps = 0
    step = engine.step

    def counted_step() -> list[RequestOutput]:
        nonlocal num_steps
        num_steps += 1
        return step()

    async_engine = AsyncLLMEngine(wrapped_engine(engine, step=counted_step))
    num_calls = 0
    outputs: dict[str, list[int]] = {}

    async def consume(request_id: str) -> None:
        params = SamplingParams(max_tokens=5, ignore_eos=True)
        async for out in async_engine.generate(request_id, [5, 6, len(request_id)], params):
            outputs.setdefault(request_id, []).extend(out.new_token_ids)

    async def main() -> None:
        nonlocal num_calls
        loop = asyncio.get_running_loop()
        call_soon_threadsafe = loop.call_soon_threadsafe

        def counted(*args: Any, **kwargs: Any) -> Any:
            nonlocal num_calls
            num_calls += 1
            return call_soon_threadsafe(*args, **kwargs)

        loop.call_soon_threadsafe = counted  # type: ignore[method-assign]
        await asyncio.gather(*(consume("r" * (i + 1)) for i in range(8)))

    try:
        asyncio.run(main())
    finally:
        async_engine.shutdown()
    assert {r: len(tokens) for r, tokens in outputs.items()} == {"r" * (i + 1): 5 for i in range(8)}
    assert num_calls <= num_steps < 40  # 40 outputs (8 requests x 5 tokens) in fewer steps


def test_a_steps_first_tokens_reach_their_consumers_before_its_later_tokens() -> None:
    """A step's outputs wake their consumers in delivery order, so a request's first token
    (what TTFT objectives hold) is delivered ahead of the same step's decode tokens."""
    engine = make_engine(num_blocks=64, block_size=4, clock=time.monotonic)
    runner = engine.runner
    assert isinstance(runner, FakeModelRunner)
    runner.sleep = True  # real step times, so "b" arrives while "a" is decoding
    runner.extra_delay_s = 0.02
    steps: list[list[tuple[str, int]]] = []
    step = engine.step

    def recorded_step() -> list[RequestOutput]:
        outputs = step()
        steps.append([(o.request_id, o.num_output_tokens) for o in outputs])
        return outputs

    async_engine = AsyncLLMEngine(wrapped_engine(engine, step=recorded_step))
    received: list[tuple[str, int]] = []

    async def consume(request_id: str, prompt: list[int], max_tokens: int) -> None:
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        async for out in async_engine.generate(request_id, prompt, params):
            received.append((out.request_id, out.num_output_tokens))

    async def main() -> None:
        # "a" decodes for 4 s at least (200 steps of 20 ms or more): "b" gets added while it
        # runs even if this machine stalls for a while.
        first = asyncio.ensure_future(consume("a", [5, 6, 7], 200))
        while len(received) < 3:
            await asyncio.sleep(0.001)
        await consume("b", [5, 6, 8], 2)
        first.cancel()
        with contextlib.suppress(asyncio.CancelledError):
            await first

    try:
        asyncio.run(main())
    finally:
        async_engine.shutdown()
    (shared,) = [s for s in steps if ("b", 1) in s]
    assert shared[0][0] == "a"  # the engine itself lists the running decode first
    later_token = next(output for output in shared if output[0] == "a")
    assert received.index(("b", 1)) < received.index(later_token)
