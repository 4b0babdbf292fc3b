"""Stop strings and streamed text through the engine, with the demo model's real tokenizer."""

from __future__ import annotations

from pathlib import Path

import pytest

from engine import (
    CacheConfig,
    EngineConfig,
    LLMEngine,
    RunnerConfig,
    SamplingParams,
    SchedulerConfig,
)
from engine.checkpoints.demo_model import write_demo_model
from engine.testing.fake_runner import FakeModelRunner
from engine.text.tokenizer import Tokenizer


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> Tokenizer:
    path: Path = write_demo_model(tmp_path_factory.mktemp("demo"))
    return Tokenizer.from_dir(path)


@pytest.fixture(params=[False, True], ids=["sync", "async"])
def async_scheduling(request: pytest.FixtureRequest) -> bool:
    return bool(request.param)


def _run(
    tokenizer: Tokenizer, params: SamplingParams, async_scheduling: bool = False
) -> tuple[str, list[str], str | None, list[int]]:
    config = EngineConfig(SchedulerConfig(max_model_len=256), CacheConfig(16),
                          async_scheduling=async_scheduling,
                          runner=RunnerConfig(num_kv_blocks=64))
    runner = FakeModelRunner(config, vocab_size=tokenizer.vocab_size)
    engine = LLMEngine(config, runner, tokenizer=tokenizer)
    engine.add_request("r", tokenizer.encode("hello"), params)
    deltas: list[str] = []
    tokens: list[int] = []
    reason = None
    while engine.has_unfinished_requests():
        for out in engine.step():
            deltas.append(out.new_text)
            tokens.extend(out.new_token_ids)
            if out.finished:
                reason = out.stop_reason
    return "".join(deltas), deltas, reason, tokens


def test_streamed_text_equals_the_full_decode(tokenizer: Tokenizer) -> None:
    text, _, _, tokens = _run(tokenizer, SamplingParams(max_tokens=40, ignore_eos=True))
    assert len(tokens) == 40
    assert text == tokenizer.decode(tokens)


def test_stop_string_across_tokens_is_cut_and_never_streamed(
    tokenizer: Tokenizer, async_scheduling: bool
) -> None:
    """Under async scheduling the stop is seen a step late: the token computed past it never
    reaches the text."""
    full, _, _, _ = _run(tokenizer, SamplingParams(max_tokens=40, ignore_eos=True))
    stop = full[10:14]  # likely spans a token boundary
    text, deltas, reason, _ = _run(tokenizer, SamplingParams(max_tokens=40, stop=[stop],
                                                          ignore_eos=True), async_scheduling)
    assert reason == stop
    assert text == full[: full.index(stop)]
    assert all(stop not in d for d in deltas)
