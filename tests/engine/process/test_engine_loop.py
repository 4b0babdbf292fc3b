"""EngineLoop: outputs after every step, statistics at a bounded rate and when idle."""

from __future__ import annotations

import threading

import pytest

from engine import EngineError, RequestOutput, SamplingParams, SchedulerStats, TenantContext
from engine.process.engine_loop import AddRequest, EngineLoop, Stop
from tests.engine.helpers import reference_output, sleeping_engine


@pytest.mark.parametrize("interval_s", [0.0, 60.0])
def test_statistics_at_a_bounded_rate_and_when_idle(interval_s: float) -> None:
    engine = sleeping_engine()  # real time: each step sleeps the fake runner's modelled time
    delivered: list[list[RequestOutput]] = []
    published: list[SchedulerStats] = []
    done = threading.Event()

    def deliver(outputs: list[RequestOutput]) -> None:
        delivered.append(outputs)
        if any(o.finished for o in outputs):
            done.set()

    def add_failed(request_id: str, exc: EngineError) -> None:
        raise AssertionError(f"{request_id}: {exc}")

    loop = EngineLoop(engine, deliver, published.append, add_failed, stats_interval_s=interval_s)
    thread = threading.Thread(target=loop.run)
    thread.start()
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    loop.submit(AddRequest("a", [5, 6, 7], params, TenantContext()))
    assert done.wait(10.0)
    loop.submit(Stop())
    thread.join(10.0)
    tokens = [t for outputs in delivered for o in outputs for t in o.new_token_ids]
    assert tokens == reference_output([5, 6, 7], 12)
    assert len(delivered) == 12  # a prefill step, then 11 decodes: outputs after every step
    if interval_s == 0.0:
        assert len(published) == len(delivered)
    else:  # the first step's, then the idle engine's
        assert len(published) == 2
    last = published[-1]
    assert last.taken_in_at_s is not None
    assert sum(t.num_running for t in last.tiers.values()) == 0
