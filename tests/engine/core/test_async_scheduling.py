"""Async scheduling: the next step is queued before the previous step's tokens are processed.

The outputs are the same as with it off, token for token (the real model: penalties, seeds,
logprobs, stop strings, n > 1, preemption; the fake runner: late stops and aborts), and every
second of measured step time is still charged to a request whose bill says so.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import CacheConfig, EngineConfig, LLMEngine, RunnerConfig, SamplingParams
from engine.testing.clock import SimulatedClock
from engine.testing.fake_runner import FakeModelRunner
from engine.text.tokenizer import Tokenizer
from engine.types import RequestOutput
from tests.engine.helpers import VOCAB, make_engine, reference_output
from tests.engine.models.helpers import model_engine
from tests.serve_process import shared_demo_model_dir

Key = tuple[str, int]


def _collect(engine: LLMEngine) -> tuple[dict[Key, list[RequestOutput]], int]:
    """Every output of each sample until the engine is idle, and the steps it took."""
    outputs: dict[Key, list[RequestOutput]] = {}
    num_calls = 0
    while engine.has_unfinished_requests():
        num_calls += 1
        assert num_calls < 10_000, "no progress"
        for out in engine.step():
            outputs.setdefault((out.request_id, out.sample_index), []).append(out)
    return outputs, num_calls


def _billed_s(outputs: dict[Key, list[RequestOutput]]) -> float:
    """What the final outputs bill, all samples together."""
    total = 0.0
    for stream in outputs.values():
        final = stream[-1]
        assert final.finished and sum(o.finished for o in stream) == 1
        assert final.metrics is not None
        # own compute, and recompute after preemptions (billed to the preempting tenant)
        total += final.metrics.gpu_seconds + final.metrics.recompute_gpu_seconds
    return total


def test_the_default_follows_the_runner() -> None:
    config = EngineConfig(cache=CacheConfig(4), runner=RunnerConfig(num_kv_blocks=16))
    runner = FakeModelRunner(config, VOCAB)
    assert not runner.runs_ahead
    assert not LLMEngine(config, runner).async_scheduling
    config = EngineConfig(cache=CacheConfig(4), async_scheduling=True,
                          runner=RunnerConfig(num_kv_blocks=16))
    assert LLMEngine(config, FakeModelRunner(config, VOCAB)).async_scheduling


def test_a_stop_found_a_step_late_drops_the_extra_token_and_bills_its_step() -> None:
    """The EOS of step N is seen after step N + 1 was queued with a decode for the request:
    that token is dropped, the request ends where it ends without async scheduling, and its
    final output waits for step N + 1's charge, so the busy time is all billed."""
    prompt = list(range(10, 30))
    expected = reference_output(prompt, 12)
    eos = expected[4]  # the fake model's fifth token ends the request
    results = {}
    for async_scheduling in (False, True):
        engine = make_engine(async_scheduling=async_scheduling)
        engine.config.eos_token_id = eos
        engine.add_request("a", prompt, SamplingParams(max_tokens=12))
        engine.add_request("b", prompt[:7], SamplingParams(max_tokens=12, ignore_eos=True))
        outputs, num_calls = _collect(engine)
        tokens = {key: [t for o in stream for t in o.new_token_ids]
                  for key, stream in outputs.items()}
        assert tokens[("a", 0)] == expected[: expected.index(eos) + 1]
        assert outputs[("a", 0)][-1].finish_reason == "stop"
        assert _billed_s(outputs) == pytest.approx(engine.busy_time_s, rel=1e-9)
        results[async_scheduling] = (tokens, engine.counters.num_steps, num_calls)
    (sync_tokens, sync_steps, sync_calls), (async_tokens, async_steps, async_calls) = (
        results[False], results[True])
    assert async_tokens == sync_tokens
    # "a" was computed one step past its EOS: "b" alone runs as long as before, one more
    # call finishes the last step in flight.
    assert async_steps == sync_steps
    assert async_calls == sync_calls + 1


def test_an_abort_while_a_step_is_in_flight_bills_that_step() -> None:
    """A request aborted while a step computing for it is queued gets its final output once
    that step is charged; an id used again at once is a new request, untouched by the old
    one's token still in flight."""
    engine = make_engine(async_scheduling=True)
    params = SamplingParams(max_tokens=30, ignore_eos=True)
    engine.add_request("a", list(range(10, 30)), params)
    engine.add_request("b", list(range(40, 50)), params)
    streams: dict[str, list[RequestOutput]] = {"a": [], "b": []}
    for _ in range(4):
        for out in engine.step():
            streams[out.request_id].append(out)
    flight = engine._in_flight
    assert flight is not None
    (old_a,) = [r for r in flight.requests if r.request_id == "a"]
    engine.abort("a")
    assert [(f.request, f.end.finish_reason) for f in flight.held] == [(old_a, "abort")]  # held
    billed_before = old_a.gpu_seconds
    engine.add_request("a", list(range(60, 66)), params)  # the id again, a new prompt
    first_step = engine.step()  # finishes the step in flight, then lets the output go
    (first_a,) = [o for o in first_step if o.request_id == "a" and o.finished]
    assert first_a.metrics is not None and first_a.metrics.gpu_seconds > billed_before
    outputs, _ = _collect(engine)
    outputs[("a", 0)] = [o for o in first_step if o.request_id == "a"] + outputs[("a", 0)]
    first_a, second_a = [o for o in outputs[("a", 0)] if o.finished]
    assert first_a.finish_reason == "abort" and first_a.metrics is not None
    assert second_a.finish_reason == "length" and second_a.num_output_tokens == 30
    tokens = [t for o in outputs[("a", 0)] for t in o.new_token_ids]
    # the old request's tokens never reach the new one: its 30 are the new prompt's
    assert tokens[-30:] == reference_output(list(range(60, 66)), 30)
    assert outputs[("b", 0)][-1].finished
    billed = _billed_s({("a", 0): [first_a], ("a", 1): [second_a], ("b", 0): outputs[("b", 0)]})
    assert billed == pytest.approx(engine.busy_time_s, rel=1e-9)


def test_workloads_bill_every_second_under_async_scheduling() -> None:
    """Preemption, forks, prefix hits and aborts: the bills add up to the busy time."""
    engine = make_engine(num_blocks=14, block_size=4, max_num_batched_tokens=24,
                         max_num_seqs=4, clock=SimulatedClock(), async_scheduling=True)
    prompts = {f"r{i}": [7 + i] * 4 + list(range(100 + 10 * i, 104 + 10 * i))
               for i in range(6)}
    for i, (request_id, prompt) in enumerate(prompts.items()):
        engine.add_request(request_id, prompt,
                           SamplingParams(max_tokens=6 + i, n=2 if i == 2 else 1,
                                          ignore_eos=True))
    streams, _ = _collect(engine)
    assert engine.scheduler.num_preemptions_total > 0
    assert _billed_s(streams) == pytest.approx(engine.busy_time_s, rel=1e-9)
    outputs = {key: [t for o in stream for t in o.new_token_ids]
               for key, stream in streams.items()}
    assert len(outputs) == 7
    for (request_id, _), tokens in outputs.items():
        assert tokens == reference_output(prompts[request_id], len(tokens))
        assert len(tokens) == 6 + int(request_id[1:])


# -- the real model ------------------------------------------------------------------------


def _demo_engine(path: Path, tokenizer: Tokenizer, async_scheduling: bool,
                 num_kv_blocks: int) -> LLMEngine:
    return model_engine(path, num_kv_blocks=num_kv_blocks, max_model_len=256,
                        max_num_batched_tokens=48, async_scheduling=async_scheduling,
                        tokenizer=tokenizer)


@pytest.mark.parametrize("num_kv_blocks", [256, 9], ids=["roomy", "preempting"])
def test_the_demo_model_gives_the_same_outputs_with_async_scheduling_on_and_off(
    num_kv_blocks: int,
) -> None:
    """Greedy and seeded sampling, penalties, logprobs, min_tokens, stop strings and n = 2,
    through the real runner: tokens, text, logprobs and finish reasons equal."""
    path = shared_demo_model_dir()
    tokenizer = Tokenizer.from_dir(path)
    prompt = tokenizer.encode("Tell me about the weather in the mountains.")
    requests = {
        "greedy": SamplingParams(temperature=0.0, max_tokens=24, logprobs=3),
        "seeded": SamplingParams(temperature=0.9, top_p=0.9, seed=5, max_tokens=24, n=2),
        "penalised": SamplingParams(temperature=0.0, max_tokens=24, repetition_penalty=1.3,
                                    frequency_penalty=0.5, presence_penalty=0.4),
        "min": SamplingParams(temperature=0.7, seed=1, max_tokens=20, min_tokens=12),
    }
    reference = _demo_engine(path, tokenizer, False, 256)
    reference.add_request("probe", prompt, SamplingParams(temperature=0.0, max_tokens=24))
    (probe,) = _collect(reference)[0].values()
    stop_text = "".join(o.new_text for o in probe)[6:9]
    assert stop_text.strip(), "a stop string from the greedy text"
    requests["stopped"] = SamplingParams(temperature=0.0, max_tokens=24, stop=[stop_text])

    def run(async_scheduling: bool) -> tuple[dict[Key, tuple], dict[Key, list[float]]]:
        engine = _demo_engine(path, tokenizer, async_scheduling, num_kv_blocks)
        for request_id, params in requests.items():
            engine.add_request(request_id, prompt, params)
        outputs, _ = _collect(engine)
        if num_kv_blocks < 256:
            assert engine.scheduler.num_preemptions_total > 0
        assert _billed_s(outputs) == pytest.approx(engine.busy_time_s, rel=1e-9)
        exact = {
            key: (
                [t for o in stream for t in o.new_token_ids],
                "".join(o.new_text for o in stream),
                [(lp.token_id, lp.rank, [t for t, _ in lp.top])
                 for o in stream for lp in o.logprobs],
                stream[-1].finish_reason,
                stream[-1].stop_reason,
            )
            for key, stream in outputs.items()
        }
        # Batches formed differently (preemption takes other turns) round differently.
        values = {key: [v for o in stream for lp in o.logprobs
                        for v in [lp.logprob] + [v for _, v in lp.top]]
                  for key, stream in outputs.items()}
        return exact, values

    (sync, sync_values), (ahead, ahead_values) = run(False), run(True)
    assert ahead == sync
    for key, values in sync_values.items():
        assert ahead_values[key] == pytest.approx(values, abs=1e-4), key
    assert len(sync) == 6
    assert sync[("stopped", 0)][3] == "stop" and sync[("stopped", 0)][4] == stop_text
    assert len(sync[("greedy", 0)][2]) == len(sync[("greedy", 0)][0])
    assert sync[("seeded", 0)][0] != sync[("seeded", 1)][0]


def test_the_mode_can_be_switched_once_the_step_in_flight_is_finished() -> None:
    """finish_in_flight leaves no step queued; the engine then goes on in the other mode with
    the same tokens (what the device benchmark does to time both modes on one engine)."""
    engine = make_engine(async_scheduling=True)
    prompt = list(range(10, 25))
    engine.add_request("a", prompt, SamplingParams(max_tokens=20, ignore_eos=True))
    tokens: list[int] = []
    for _ in range(5):
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    tokens += [t for o in engine.finish_in_flight() for t in o.new_token_ids]
    assert engine._in_flight is None and len(engine.finish_in_flight()) == 0
    engine.async_scheduling = False
    for _ in range(5):
        tokens += [t for o in engine.step() for t in o.new_token_ids]
    engine.async_scheduling = True
    outputs, _ = _collect(engine)
    tokens += [t for stream in outputs.values() for o in stream for t in o.new_token_ids]
    assert tokens == reference_output(prompt, 20)
