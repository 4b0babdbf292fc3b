"""EngineProcess: the engine loop in a spawned process, over the fake runner (real time)."""

from __future__ import annotations

import asyncio
import functools
import os
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from engine import EngineDeadError, InvalidRequestError, SamplingParams, TenantContext
from engine.core.scheduler_stats import SchedulerStats
from engine.process.engine_process import EngineProcess
from tests.engine.helpers import (
    engine_noting_refusals,
    engine_without_weights,
    reference_output,
    sleeping_engine,
)


@pytest.fixture
def engine_process() -> Iterator[EngineProcess]:
    process = EngineProcess(sleeping_engine)
    yield process
    process.shutdown()


def _num_running(stats: SchedulerStats) -> int:
    return sum(tier.num_running + tier.num_waiting for tier in stats.tiers.values())


async def _idle_stats(engine: EngineProcess, deadline_s: float = 10.0) -> SchedulerStats:
    """The statistics once the engine holds no request and no KV block (or the last seen)."""
    until = time.monotonic() + deadline_s
    while time.monotonic() < until:
        stats = engine.stats()
        if _num_running(stats) == 0 and stats.num_kv_blocks_used == 0:
            break
        await asyncio.sleep(0.01)
    return engine.stats()


def test_outputs_stream_from_the_engine_process_and_leaving_early_aborts(
    engine_process: EngineProcess,
) -> None:
    async def main() -> tuple[list[list[int]], int, SchedulerStats]:
        async def collect(request_id: str, prompt: list[int]) -> list[int]:
            tokens: list[int] = []
            params = SamplingParams(max_tokens=6, ignore_eos=True)
            async for out in engine_process.generate(request_id, prompt, params):
                tokens.extend(out.new_token_ids)
                # metering rides on the first token and on the end only (lean messages)
                assert (out.metrics is not None) == (out.finished or out.num_output_tokens == 1)
            return tokens

        streams = await asyncio.gather(*(collect(f"r{i}", [5, 6, i]) for i in range(4)))
        num_seen = 0
        long = SamplingParams(max_tokens=200, ignore_eos=True)
        async for _ in engine_process.generate("gone", [5, 6, 9], long):
            num_seen += 1
            if num_seen == 3:
                break  # the client went away
        return streams, num_seen, await _idle_stats(engine_process)

    streams, num_seen, stats = asyncio.run(main())
    assert streams == [reference_output([5, 6, i], 6) for i in range(4)]
    assert num_seen == 3
    # The abort reached the process: nothing runs, no block is held, and the aborted request
    # stopped well short of its 200 tokens.
    assert _num_running(stats) == 0 and stats.num_kv_blocks_used == 0
    assert stats.counters.num_generated_tokens < 4 * 6 + 100


def test_statistics_come_from_the_process_and_say_when_their_step_took_requests_in(
    engine_process: EngineProcess,
) -> None:
    assert engine_process.stats().taken_in_at_s is None  # no step yet

    async def main() -> None:
        async for _ in engine_process.generate("a", [5, 6, 7], SamplingParams(max_tokens=2)):
            pass

    submitted_s = time.monotonic()
    asyncio.run(main())
    stats = engine_process.stats()
    assert stats.taken_in_at_s is not None
    assert submitted_s <= stats.taken_in_at_s <= time.monotonic()
    assert stats.counters.num_prompt_tokens == 3


def test_bad_requests_fail_their_caller_only(engine_process: EngineProcess) -> None:
    """Checked in the caller's process before sending (an empty prompt, an id in use), or
    by the engine's (stop strings, which this engine without a tokenizer cannot match):
    either way that caller gets the error and the others run on."""

    async def consume(
        request_id: str, prompt: list[int], max_tokens: int, stop: list[str] | None = None
    ) -> list[int]:
        tokens: list[int] = []
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True, stop=stop or [])
        async for out in engine_process.generate(request_id, prompt, params):
            tokens.extend(out.new_token_ids)
        return tokens

    async def main() -> list[int]:
        with pytest.raises(InvalidRequestError, match="empty"):
            await consume("empty", [], 2)
        first = asyncio.ensure_future(consume("same", [1, 2, 3], 30))
        await asyncio.sleep(0.05)
        with pytest.raises(InvalidRequestError, match="already in use"):
            await consume("same", [4, 5, 6], 2)
        with pytest.raises(InvalidRequestError, match="stop strings need a tokenizer"):
            await consume("stop", [4, 5, 6], 2, stop=["x"])
        return await first

    assert asyncio.run(main()) == reference_output([1, 2, 3], 30)
    assert engine_process.is_running


def test_a_build_that_fails_is_reported_by_the_constructor() -> None:
    with pytest.raises(EngineDeadError, match="could not start: FileNotFoundError: no checkpoint"):
        EngineProcess(engine_without_weights)


def test_open_streams_end_when_the_engine_process_dies() -> None:
    engine = EngineProcess(functools.partial(sleeping_engine, step_delay_s=0.01))
    pid = engine.pid
    assert pid is not None

    async def main() -> int:
        num_seen = 0
        with pytest.raises(EngineDeadError):
            params = SamplingParams(max_tokens=200, ignore_eos=True)
            async for _ in engine.generate("long", [5, 6, 7], params):
                num_seen += 1
                if num_seen == 2:
                    os.kill(pid, signal.SIGKILL)
        return num_seen

    try:
        assert asyncio.run(main()) >= 2
        assert not engine.is_running
        with pytest.raises(EngineDeadError):
            asyncio.run(_first_output(engine))
    finally:
        engine.shutdown()


async def _first_output(engine: EngineProcess) -> None:
    async for _ in engine.generate("after", [1, 2], SamplingParams(max_tokens=1)):
        return


def test_refused_requests_reach_the_engine_process_and_shutdown_stops_it(
    tmp_path: Path,
) -> None:
    noted = tmp_path / "refused"
    engine = EngineProcess(functools.partial(engine_noting_refusals, noted))
    tenant = TenantContext(tenant_id="heavy", tier="standard", priority=1)
    engine.record_refused(40, tenant)

    async def main() -> None:
        # Commands are applied in the order sent, before the step that serves this request.
        async for _ in engine.generate("a", [5, 6, 7], SamplingParams(max_tokens=2), tenant):
            pass

    asyncio.run(main())
    engine.shutdown()
    assert not engine.is_running
    assert engine._process.exitcode == 0  # it left its loop when told, not killed
    assert noted.read_text() == "heavy 40\n"
