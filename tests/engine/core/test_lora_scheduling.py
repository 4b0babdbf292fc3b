"""Adapter slots as a scheduling resource, and prefix-cache keys per adapter (fake runner).

No step holds more distinct adapters than the runner's slots; a request on a cold adapter
is not overtaken by later requests on the adapters that hold the slots and gets one when
they drain; a premium request takes a batch-tier adapter's slot; cached blocks never cross
adapters or the base model.
"""

from __future__ import annotations

from typing import cast

from engine import LLMEngine, LoraRequest, SamplingParams, TenantContext
from engine.testing.fake_runner import FakeModelRunner
from tests.engine.helpers import make_engine, reference_output, run_to_completion

STANDARD = TenantContext(tenant_id="s", tier="standard", priority=1)


def _lora(name: str) -> LoraRequest:
    return LoraRequest(name=name, path=f"/adapters/{name}")  # the fake runner reads no files


def _params(max_tokens: int) -> SamplingParams:
    return SamplingParams(max_tokens=max_tokens, ignore_eos=True)


def _runner(engine: LLMEngine) -> FakeModelRunner:
    return cast(FakeModelRunner, engine.runner)


def test_steps_never_hold_more_adapters_than_slots() -> None:
    engine = make_engine(num_blocks=128, max_num_seqs=16, max_loras=2)
    prompts = {f"r{i}": list(range(3 + i, 12 + 2 * i)) for i in range(14)}
    for i, (request_id, prompt) in enumerate(prompts.items()):
        lora = None if i % 7 == 6 else _lora(f"a{i % 6}")
        engine.add_request(request_id, prompt, _params(6 + i % 5), STANDARD, lora=lora)
    outputs = run_to_completion(engine)
    assert _runner(engine).most_adapters_in_a_step == 2
    assert _runner(engine).lora_holds == {}  # every request's hold released
    for i, (request_id, prompt) in enumerate(prompts.items()):
        assert outputs[(request_id, 0)] == reference_output(prompt, 6 + i % 5)


def test_a_cold_adapter_is_not_overtaken_and_gets_a_slot() -> None:
    """One slot; a hot adapter gets a new request every step. A request on a cold adapter
    waits while the hot adapter's running requests finish; no hot request that came after it
    starts before it; then it runs."""
    engine = make_engine(num_blocks=256, max_num_seqs=16, max_loras=1)
    started: dict[str, int] = {}
    arrived: dict[str, int] = {}
    for step in range(60):
        request_id = f"hot{step}"
        engine.add_request(request_id, [7, 8, 9, step + 10], _params(8), STANDARD,
                           lora=_lora("hot"))
        arrived[request_id] = step
        if step == 5:
            engine.add_request("cold", [1, 2, 3], _params(8), STANDARD, lora=_lora("cold"))
            arrived["cold"] = step
        engine.step()
        for request in engine.scheduler.running:
            started.setdefault(request.request_id, step)
    assert "cold" in started
    # bounded: the hot requests running when it came need at most 8 more steps each
    assert started["cold"] <= arrived["cold"] + 10
    assert all(started[r] > started["cold"] for r in started if arrived[r] > arrived["cold"])
    assert _runner(engine).most_adapters_in_a_step == 1


def test_a_premium_request_takes_a_batch_adapters_slot() -> None:
    engine = make_engine(num_blocks=128, max_loras=1)
    batch = TenantContext(tenant_id="b", tier="batch", priority=2)
    premium = TenantContext(tenant_id="p", tier="premium", priority=0)
    tokens: dict[str, list[int]] = {"slow": [], "fast": []}
    engine.add_request("slow", list(range(20)), _params(30), batch, lora=_lora("batch-a"))
    for _ in range(3):
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    engine.add_request("fast", list(range(5)), _params(4), premium, lora=_lora("premium-a"))
    for output in engine.step():
        tokens[output.request_id] += output.new_token_ids
    assert {r.request_id for r in engine.scheduler.running} == {"fast"}
    assert engine.scheduler.num_preemptions_total == 1
    for (request_id, _), new in run_to_completion(engine).items():
        tokens[request_id] += new
    assert tokens["fast"] == reference_output(list(range(5)), 4)
    assert tokens["slow"] == reference_output(list(range(20)), 30)  # resumed after it


def test_a_standard_request_does_not_take_a_slot_of_its_own_tier() -> None:
    engine = make_engine(num_blocks=128, max_loras=1)
    engine.add_request("first", list(range(20)), _params(10), STANDARD, lora=_lora("x"))
    engine.step()
    engine.add_request("second", list(range(5)), _params(4), STANDARD, lora=_lora("y"))
    # another tenant's base-model request needs no slot and goes ahead (the waiting tenant's
    # own later requests keep their order behind it)
    engine.add_request("base", list(range(6)), _params(4),
                       TenantContext(tenant_id="t", tier="standard", priority=1))
    engine.step()
    running = {r.request_id for r in engine.scheduler.running}
    assert running == {"first", "base"}
    assert engine.scheduler.num_preemptions_total == 0
    run_to_completion(engine)


def _cached_tokens(engine: LLMEngine, request_id: str, prompt: list[int],
                   lora: LoraRequest | None) -> int:
    engine.add_request(request_id, prompt, _params(1), STANDARD, lora=lora)
    cached = -1
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                cached = output.num_cached_tokens
    return cached


def test_prefix_cache_hits_never_cross_adapters() -> None:
    engine = make_engine(num_blocks=64, block_size=4)
    prompt = list(range(100, 117))  # four full blocks and one token
    assert _cached_tokens(engine, "a1", prompt, _lora("a")) == 0
    assert _cached_tokens(engine, "a2", prompt, _lora("a")) == 16
    assert _cached_tokens(engine, "b1", prompt, _lora("b")) == 0
    assert _cached_tokens(engine, "base1", prompt, None) == 0
    assert _cached_tokens(engine, "base2", prompt, None) == 16
    assert _cached_tokens(engine, "b2", prompt, _lora("b")) == 16
