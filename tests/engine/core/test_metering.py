"""Step metering: exact FLOP-proportional splits, recompute charged to the preemptor, and
conservation (per-request GPU seconds add up to the engine's busy time) over mixed loads."""

from __future__ import annotations

import dataclasses
import math
import random
import time

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from engine import (
    CacheConfig,
    EngineConfig,
    LLMEngine,
    RequestOutput,
    RunnerConfig,
    SamplingParams,
    SchedulerConfig,
    TenantContext,
)
from engine.core.metering import split_step_time
from engine.models.config import ModelConfig
from engine.scheduler_output import ScheduledChunk
from engine.testing.clock import SimulatedClock
from engine.testing.fake_runner import FakeModelRunner
from engine.worker.flops import FlopsCounter, linear_params_per_token
from engine.worker.model_runner import TorchModelRunner
from policies import TieredFairQueue, TieredPolicy
from tests.engine.helpers import VOCAB, check_invariants, make_engine

PREMIUM = TenantContext(tenant_id="p", tier="premium", priority=0, cache_salt="p")
STANDARD = TenantContext(tenant_id="s", tier="standard", priority=1, cache_salt="s")
BATCH = TenantContext(tenant_id="b", tier="batch", priority=2, cache_salt="b")
PRIORITY = {"p": 0, "s": 1, "b": 2}

TINY_LLAMA = ModelConfig.from_dict(
    {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "vocab_size": 256,
        "hidden_size": 64,
        "intermediate_size": 128,
        "num_hidden_layers": 2,
        "num_attention_heads": 4,
        "num_key_value_heads": 2,
        "max_position_embeddings": 512,
        "rms_norm_eps": 1e-5,
    }
)
# Same shapes, one layer with a 12-key sliding window: per-token costs stop growing.
WINDOWED = dataclasses.replace(TINY_LLAMA, sliding_windows=(None, 12))

# Every test here runs with synchronous and with async scheduling.
pytestmark = pytest.mark.usefixtures("scheduling_mode")


def _params(max_tokens: int, n: int = 1) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, n=n, ignore_eos=True)


def _chunk(request_id: str, start_pos: int, num_tokens: int, needs_sample: bool) -> ScheduledChunk:
    return ScheduledChunk(
        request_id=request_id,
        start_pos=start_pos,
        num_tokens=num_tokens,
        needs_sample=needs_sample,
        is_prefill=num_tokens > 1,
    )


def _token_flops(config: ModelConfig, position: int) -> int:
    """FLOPs of the one token at position (0-based), from the model's shapes, token by token."""
    attention = sum(
        4 * config.head_dim * config.num_heads * min(position + 1, window or position + 1)
        for window in config.sliding_windows
    )
    return 2 * linear_params_per_token(config) + attention


@settings(max_examples=200, deadline=None)
@given(
    num_new=st.integers(0, 120),
    num_cached=st.integers(0, 600),
    num_sampled=st.integers(0, 2),
    windows=st.sampled_from([None, (None, None), (64, None), (16, 512, 1)]),
)
def test_flops_counter_counts_token_by_token(
    num_new: int, num_cached: int, num_sampled: int, windows: tuple[int | None, ...] | None
) -> None:
    """The counter (layers of one window counted together, closed-form key sums) against the
    model's shapes summed token by token."""
    config = TINY_LLAMA if windows is None else dataclasses.replace(
        TINY_LLAMA, sliding_windows=windows
    )
    expected = sum(_token_flops(config, p) for p in range(num_cached, num_cached + num_new))
    if num_new:
        expected += 2 * config.hidden_size * config.vocab_size * num_sampled
    counter = FlopsCounter(config)
    assert counter(num_new, num_cached + num_new, num_sampled) == expected
    # and vectorized (metering's estimator), alone and among other chunks
    many = counter.many(np.array([num_new, 3, 0]), np.array([num_cached + num_new, 700, 5]),
                        np.array([num_sampled, 1, 1]))
    assert many.tolist() == [expected, counter(3, 700, 1), 0.0]


def _fake_clock_engine(
    num_blocks: int = 32,
    max_num_batched_tokens: int = 32,
    max_num_seqs: int = 6,
    prefix_caching: bool = True,
) -> tuple[LLMEngine, FakeModelRunner, SimulatedClock]:
    """An engine whose clock only moves by the fake runner's modelled step times."""
    clock = SimulatedClock()
    config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=max_num_batched_tokens,
            max_num_seqs=max_num_seqs,
            max_model_len=256,
        ),
        cache=CacheConfig(4, prefix_caching, {}),
        runner=RunnerConfig(num_kv_blocks=num_blocks),
    )
    runner = FakeModelRunner(config, VOCAB, advance_clock=clock.advance)
    return LLMEngine(config, runner, TieredPolicy(), clock=clock), runner, clock


def _charged_s(output: RequestOutput) -> float:
    assert output.metrics is not None
    return output.metrics.gpu_seconds + output.metrics.recompute_gpu_seconds


# -- the split -----------------------------------------------------------------------------------


@settings(max_examples=300, deadline=None)
@given(
    shapes=st.lists(
        st.tuples(
            st.integers(0, 300),  # start_pos
            st.integers(1, 64),  # num_tokens
            st.booleans(),  # needs_sample
            st.integers(0, 400),  # high-water mark
        ),
        min_size=1,
        max_size=8,
    ),
    step_time_s=st.floats(1e-7, 10.0, allow_nan=False, allow_infinity=False),
    windowed=st.booleans(),
)
def test_split_is_exact_proportional_to_flops_and_separates_recompute(
    shapes: list[tuple[int, int, bool, int]], step_time_s: float, windowed: bool
) -> None:
    config = WINDOWED if windowed else TINY_LLAMA
    chunks = [_chunk(f"r{i}", s, k, sample) for i, (s, k, sample, _) in enumerate(shapes)]
    high_water = {f"r{i}": hw for i, (*_, hw) in enumerate(shapes)}

    split = split_step_time(chunks, high_water, step_time_s, FlopsCounter(config).many)

    parts = [x for own_s, old_s in zip(split.gpu_seconds, split.recompute_gpu_seconds,
                                       strict=True) for x in (own_s, old_s)]
    assert sum(parts) == step_time_s and sum(reversed(parts)) == step_time_s
    assert math.fsum(parts) == step_time_s
    assert min(parts) >= 0.0
    # Expected weights, token by token: positions below the high-water mark are recompute;
    # the lm_head row belongs to the chunk's last (new) token.
    lm_head = 2 * config.hidden_size * config.vocab_size
    expected: list[float] = []
    for (start, num_tokens, sample, hw), num_old, old_s in zip(
        shapes, split.num_recomputed_tokens, split.recompute_gpu_seconds, strict=True
    ):
        positions = range(start, start + num_tokens)
        old = [p for p in positions if p < hw]
        assert num_old == len(old)
        own = sum(_token_flops(config, p) for p in positions if p >= hw)
        own += lm_head if sample and len(old) < num_tokens else 0
        expected += [own, sum(_token_flops(config, p) for p in old)]
        if not old:
            assert old_s == 0.0
    total = sum(expected)
    for part, weight in zip(parts, expected, strict=True):
        assert abs(part - step_time_s * weight / total) <= len(parts) * math.ulp(step_time_s)
    assert len(split.gpu_seconds) == len(chunks)


def test_split_without_a_cost_model_falls_back_to_token_counts() -> None:
    chunks = [_chunk("a", 0, 3, True), _chunk("b", 4, 1, True)]
    split = split_step_time(chunks, {"a": 2}, 0.8, lambda n, c, s: np.zeros(len(n)))
    parts = [x for own_s, old_s in zip(split.gpu_seconds, split.recompute_gpu_seconds,
                                       strict=True) for x in (own_s, old_s)]
    assert parts == pytest.approx([0.2, 0.4, 0.2, 0.0], rel=1e-15, abs=1e-16)
    assert sum(parts) == 0.8


def test_an_adapters_flops_count_in_its_chunks_share() -> None:
    """Two equal chunks, one on an adapter: it pays its update's FLOPs on every token, own
    and recomputed; the base chunk pays the model alone."""
    counter = FlopsCounter(TINY_LLAMA)
    chunks = [_chunk("base", 0, 10, True), _chunk("adapted", 0, 10, True)]
    per_token = 5e5
    split = split_step_time(chunks, {"adapted": 4}, 1.0, counter.many,
                            np.array([0.0, per_token]))
    own = counter(10, 10) - counter(4, 4, 0)  # what "adapted" computes first-hand, then again
    model = [counter(10, 10), own, counter(4, 4, 0)]
    weights = [model[0], model[1] + 6 * per_token, model[2] + 4 * per_token]
    total = sum(weights)
    assert split.gpu_seconds[0] == pytest.approx(weights[0] / total, rel=1e-9)
    assert split.gpu_seconds[1] == pytest.approx(weights[1] / total, rel=1e-9)
    assert split.recompute_gpu_seconds[1] == pytest.approx(weights[2] / total, rel=1e-9)
    assert math.fsum([*split.gpu_seconds, *split.recompute_gpu_seconds]) == 1.0


# -- the engine ----------------------------------------------------------------------------------


def test_one_step_is_split_by_flops_and_times_are_reported() -> None:
    engine, runner, clock = _fake_clock_engine(max_num_seqs=2)
    engine.add_request("a", list(range(10, 18)), _params(1))
    engine.add_request("b", list(range(20, 36)), _params(1))
    engine.add_request("c", list(range(40, 44)), _params(1))  # waits: two sequences at most
    first = {o.request_id: o for o in engine.step()}
    step_s = clock.now
    a, b = first["a"].metrics, first["b"].metrics
    assert a is not None and b is not None
    assert a.gpu_seconds + b.gpu_seconds == engine.busy_time_s == step_s > 0
    flops = runner.estimate_flops(np.array([8, 16]), np.array([8, 16]), np.array([1, 1]))
    ratio = flops[0] / flops[1]
    assert a.gpu_seconds / b.gpu_seconds == pytest.approx(ratio, rel=1e-12)
    assert a.queue_time_s == 0.0 and a.ttft_s == a.e2e_time_s == step_s
    assert a.recompute_gpu_seconds == 0.0 and a.recompute_charged_tenant_id is None
    (c_out,) = engine.step()
    c = c_out.metrics
    assert c is not None and c.queue_time_s == step_s
    assert c.gpu_seconds == engine.busy_time_s - step_s == clock.now - step_s
    counters = engine.stats().counters
    assert counters.num_steps == 2 and counters.last_step_time_s == c.gpu_seconds
    assert counters.num_prompt_tokens == 8 + 16 + 4 and counters.num_generated_tokens == 3


def test_device_sync_time_is_inside_the_step() -> None:
    clock = SimulatedClock()

    class DeviceLagRunner(FakeModelRunner):
        """Test tool: its device finishes 0.25 s after execute returns."""

        def synchronize(self) -> None:
            clock.advance(0.25)

    config = EngineConfig(cache=CacheConfig(4), runner=RunnerConfig(num_kv_blocks=16))
    runner = DeviceLagRunner(config, VOCAB, advance_clock=clock.advance)
    engine = LLMEngine(config, runner, clock=clock)
    engine.add_request("a", [5, 6, 7], _params(1))
    (out,) = engine.step()
    assert out.metrics is not None and out.metrics.gpu_seconds == engine.busy_time_s == clock.now
    assert clock.now > 0.25


def test_recompute_is_charged_to_the_preempting_tenant() -> None:
    engine = make_engine(num_blocks=12, block_size=4, queue=TieredFairQueue(), prefix_caching=False)
    engine.add_request("std", list(range(100, 124)), _params(20), STANDARD)
    for _ in range(6):  # past the thrash guard
        engine.step()
    engine.add_request("prem", list(range(200, 224)), _params(8), PREMIUM)
    finals = {o.request_id: o for o in engine.step() if o.finished}
    std_request = engine.scheduler.requests["std"]
    assert std_request.num_preemptions == 1
    num_lost = std_request.num_computed_high_water  # no prefix cache: all of it is recomputed
    while engine.has_unfinished_requests():
        finals.update((o.request_id, o) for o in engine.step() if o.finished)
    std, prem = finals["std"].metrics, finals["prem"].metrics
    assert std is not None and prem is not None
    assert std.num_recomputed_tokens == num_lost > 0
    assert std.recompute_charged_tenant_id == "p"
    assert list(std.recompute_gpu_seconds_by_tenant) == ["p"]
    assert std.recompute_gpu_seconds == std.recompute_gpu_seconds_by_tenant["p"] > 0
    assert prem.recompute_gpu_seconds == 0.0 and prem.num_recomputed_tokens == 0
    counters = engine.stats().counters
    assert counters.num_recomputed_tokens == num_lost and counters.num_preemptions == 1
    assert counters.recompute_time_s == std.recompute_gpu_seconds
    total = math.fsum(_charged_s(o) for o in finals.values())
    assert total == pytest.approx(engine.busy_time_s, rel=1e-12)


def test_failed_steps_and_aborts_are_charged() -> None:
    engine, runner, clock = _fake_clock_engine()
    engine.add_request("a", list(range(10, 30)), _params(10))
    engine.step()
    runner.fail_next_step = True
    (failed,) = engine.step()
    assert failed.finish_reason == "error" and failed.metrics is not None
    assert failed.metrics.gpu_seconds == engine.busy_time_s == clock.now
    engine.add_request("b", list(range(10, 30)), _params(10))
    engine.step()
    engine.step()
    engine.abort("b")
    (aborted,) = engine.step()
    assert aborted.finish_reason == "abort" and aborted.metrics is not None
    assert aborted.metrics.gpu_seconds + failed.metrics.gpu_seconds == clock.now
    counters = engine.stats().counters
    assert counters.num_steps == 4 and counters.num_failed_steps == 1


def test_parallel_samples_meter_the_shared_prompt_on_the_sample_that_computed_it() -> None:
    engine, _, clock = _fake_clock_engine()
    engine.add_request("g", list(range(10, 30)), _params(3, n=2))
    engine.step()  # sample 0 computes the prompt; sample 1 forks once it is written
    prompt_s = clock.now
    finals: dict[int, RequestOutput] = {}
    while engine.has_unfinished_requests():
        finals.update((o.sample_index, o) for o in engine.step() if o.finished)
    first, second = finals[0].metrics, finals[1].metrics
    assert first is not None and second is not None
    assert first.gpu_seconds + second.gpu_seconds == pytest.approx(clock.now, rel=1e-12)
    # Sample 1 starts a step late and ends a step late, alone. In between both samples
    # compute one token per step (the fork recomputes the last prompt token in its private
    # block): near-equal shares of the same steps.
    last_s = engine.stats().counters.last_step_time_s
    assert last_s is not None and engine.stats().counters.num_steps == 4
    assert first.gpu_seconds - prompt_s == pytest.approx(second.gpu_seconds - last_s, rel=1e-3)
    assert engine.stats().counters.num_prompt_tokens == 20 + 1


def _run_mixed_load(engine: LLMEngine, runner: FakeModelRunner) -> dict[str, RequestOutput]:
    """Three tiers with shared prefixes, n > 1, an abort and a failing step; the final output
    of every sample, by "<id>#<sample>"."""
    rng = random.Random(7)
    shared = {t: [rng.randrange(3, VOCAB) for _ in range(12)] for t in PRIORITY}
    tenants = {"p": PREMIUM, "s": STANDARD, "b": BATCH}
    finals: dict[str, RequestOutput] = {}
    num_added = 0
    for step in range(2000):
        if step < 48 and step % 2 == 0:
            name = "bbsbsp"[num_added % 6]
            suffix = [rng.randrange(3, VOCAB) for _ in range(rng.randrange(1, 14))]
            n = 2 if num_added % 5 == 3 else 1
            engine.add_request(
                f"{name}{num_added}",
                shared[name] + suffix,
                _params(rng.randrange(8, 30), n),
                tenants[name],
            )
            num_added += 1
        if step == 21:
            engine.abort(next(iter(r.group_id for r in engine.scheduler.running)))
        if step == 30:
            runner.fail_next_step = True
        for out in engine.step():
            if out.finished:
                key = f"{out.request_id}#{out.sample_index}"
                assert key not in finals, "two final outputs for one sample"
                finals[key] = out
        check_invariants(engine)
        if step >= 48 and not engine.has_unfinished_requests():
            return finals
    raise AssertionError("the load did not finish")


def test_conservation_over_a_mixed_load() -> None:
    engine, runner, clock = _fake_clock_engine(num_blocks=28, max_num_batched_tokens=24)
    finals = _run_mixed_load(engine, runner)
    counters = engine.stats().counters
    metrics = [o.metrics for o in finals.values() if o.metrics is not None]
    assert len(metrics) == len(finals)
    # The load did what it is meant to exercise.
    reasons = [o.finish_reason for o in finals.values()]
    assert reasons.count("abort") >= 1 and reasons.count("error") >= 1
    assert counters.num_failed_steps == 1 and counters.num_preemptions >= 2
    assert any(o.num_cached_tokens > 0 for o in finals.values()), "no prefix hit"
    assert any(o.sample_index == 1 for o in finals.values()), "no n > 1 request"
    recomputed = [m for m in metrics if m.num_recomputed_tokens]
    assert recomputed, "no recompute"
    # Conservation: every second of busy time is charged to exactly one sample.
    total = math.fsum(m.gpu_seconds + m.recompute_gpu_seconds for m in metrics)
    assert total == pytest.approx(engine.busy_time_s, rel=1e-9)
    assert engine.busy_time_s == pytest.approx(clock.now, rel=1e-12)  # only steps move it
    assert counters.recompute_time_s == pytest.approx(
        math.fsum(m.recompute_gpu_seconds for m in metrics), rel=1e-9
    )
    assert counters.num_recomputed_tokens == sum(m.num_recomputed_tokens for m in metrics)
    # Recompute is charged to a tenant of the same or a more important tier, and to another
    # tier at least once (a premium or standard request preempting a less important one).
    charged_elsewhere = False
    for key, out in finals.items():
        m = out.metrics
        assert m is not None
        assert m.recompute_gpu_seconds == pytest.approx(
            math.fsum(m.recompute_gpu_seconds_by_tenant.values()), rel=1e-12
        )
        victim = key[0]
        for tenant_id in m.recompute_gpu_seconds_by_tenant:
            assert PRIORITY[tenant_id] <= PRIORITY[victim]
            charged_elsewhere |= tenant_id != victim
        if m.num_recomputed_tokens == 0:
            assert m.recompute_charged_tenant_id is None and m.recompute_gpu_seconds == 0.0
        if m.first_scheduled_time is not None:
            assert m.queue_time_s is not None and m.queue_time_s >= 0.0
            if m.ttft_s is not None:
                assert m.ttft_s > m.queue_time_s
    assert charged_elsewhere


def test_stats_carry_a_copy_of_the_counters() -> None:
    engine, _, clock = _fake_clock_engine()
    engine.add_request("a", [5, 6, 7], _params(3))
    engine.step()
    snapshot = engine.stats().counters
    engine.step()
    assert snapshot.num_steps == 1 and snapshot.busy_time_s < engine.busy_time_s == clock.now


def test_torch_runner_busy_time_is_conserved_on_the_real_clock() -> None:
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=4, max_model_len=256),
        cache=CacheConfig(16),
        runner=RunnerConfig(num_kv_blocks=24),
    )
    engine = LLMEngine(config, TorchModelRunner.from_random(TINY_LLAMA, 5, config))
    rng = random.Random(3)
    for i, (num_prompt, n) in enumerate([(40, 1), (9, 2), (70, 1)]):
        prompt = [rng.randrange(3, 256) for _ in range(num_prompt)]
        engine.add_request(f"r{i}", prompt, _params(6, n))
    started = time.monotonic()
    finals: list[RequestOutput] = []
    while engine.has_unfinished_requests():
        finals += [o for o in engine.step() if o.finished]
    elapsed_s = time.monotonic() - started
    assert len(finals) == 4 and all(o.finish_reason == "length" for o in finals)
    counters = engine.stats().counters
    assert 0 < engine.busy_time_s <= elapsed_s and counters.num_steps >= 6
    total = math.fsum(_charged_s(o) for o in finals)
    assert total == pytest.approx(engine.busy_time_s, rel=1e-9)
    assert counters.num_prompt_tokens == 40 + 9 + 70 + 1  # + the fork's private last token
    assert counters.num_generated_tokens == 4 * 6
