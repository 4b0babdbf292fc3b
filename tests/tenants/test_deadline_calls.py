"""DeadlineCalls: a caller waits at most its deadline, a call past it goes on and is told it
was abandoned, and past max_stuck such calls no new one starts."""

from __future__ import annotations

import asyncio
import threading
import time

import pytest

from tenants import CallTimedOut, DeadlineCalls


def test_calls_past_their_deadline_are_left_running_and_bounded() -> None:
    calls = DeadlineCalls("test-db", max_stuck=2)
    release = threading.Event()
    abandoned: list[threading.Event] = []
    started: list[str] = []

    def hung(was_abandoned: threading.Event) -> str:
        started.append("hung")
        abandoned.append(was_abandoned)
        release.wait(30)
        return "late"

    assert calls.call(lambda _a: "answer", 1.0) == "answer"
    for _ in range(2):
        begun = time.monotonic()
        with pytest.raises(CallTimedOut):
            calls.call(hung, 0.1)
        assert time.monotonic() - begun < 1.0
    assert calls.num_stuck == 2 and all(event.is_set() for event in abandoned)
    with pytest.raises(CallTimedOut, match="2 earlier calls"):  # not started at all
        asyncio.run(calls.acall(hung, 0.1))
    assert len(started) == 2
    release.set()
    deadline = time.monotonic() + 10
    while calls.num_stuck:
        assert time.monotonic() < deadline, "the stuck calls did not end"
        time.sleep(0.01)
    assert asyncio.run(calls.acall(lambda _a: "again", 1.0)) == "again"


def test_an_error_reaches_the_caller() -> None:
    def fails(_abandoned: threading.Event) -> None:
        raise ValueError("no")

    with pytest.raises(ValueError, match="no"):
        DeadlineCalls("test-db", max_stuck=1).call(fails, 1.0)
