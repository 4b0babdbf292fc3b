"""The memory helpers of ops/bench's hostile-tenant scripts: a server's VmRSS found through
/proc, with a real process and its spawned child, and the peak a PeakSampler keeps."""

from __future__ import annotations

import multiprocessing
import os
import threading
import time
from dataclasses import dataclass
from typing import Any

from bench.serve.peak_sampler import PeakSampler
from bench.serve.process_memory import ServerRssReader, vm_rss_kib


@dataclass(frozen=True)
class _Pair:
    first: int
    second: int


def test_each_field_keeps_its_own_peak() -> None:
    samples = iter([_Pair(1, 9), _Pair(5, 2), _Pair(3, 4)])
    last = _Pair(0, 0)
    lock = threading.Lock()

    def read() -> _Pair:
        nonlocal last
        with lock:
            last = next(samples, last)
            return last

    sampler = PeakSampler(read, every_s=0.001)
    sampler.start()
    time.sleep(0.05)
    assert sampler.stop() == _Pair(5, 9)


def test_a_sampler_stopped_at_once_returns_a_sample() -> None:
    sampler = PeakSampler(lambda: _Pair(7, 8), every_s=10.0)
    sampler.start()
    assert sampler.stop() == _Pair(7, 8)


def _wait(started: Any, release: Any) -> None:
    started.set()
    release.wait(30)


def test_the_engine_is_the_child_that_runs_spawn_main() -> None:
    context = multiprocessing.get_context("spawn")
    started, release = context.Event(), context.Event()
    child = context.Process(target=_wait, args=(started, release))
    child.start()
    try:
        # start() returns before the child has exec'd its command line (a server's engine
        # has long before the server answers)
        assert started.wait(30)
        reader = ServerRssReader(os.getpid())
        assert reader.engine_pid == child.pid
        rss = reader.read()
        assert rss.gateway_kib > 0 and rss.engine_kib > 0
        assert vm_rss_kib(os.getpid()) > 0
    finally:
        release.set()
        child.join()
