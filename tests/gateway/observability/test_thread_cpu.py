"""Each Python thread's CPU time, sampled from another thread, and what each used between
two samples."""

from __future__ import annotations

import sys
import threading
import time

import pytest

from gateway.observability.thread_cpu import ThreadCpuClocks, cpu_by_thread

pytestmark = pytest.mark.skipif(
    not sys.platform.startswith("linux"), reason="per-thread CPU clocks are POSIX's"
)

SPIN_S = 0.2


def _spin(seconds: float) -> None:
    end_s = time.perf_counter() + seconds
    while time.perf_counter() < end_s:
        pass


def test_a_busy_thread_is_named_with_its_cpu_time_and_an_idle_one_is_not() -> None:
    release = threading.Event()

    def spin_then_park() -> None:
        _spin(SPIN_S)
        release.wait()

    parked = threading.Thread(target=release.wait, name="parked", daemon=True)
    parked.start()
    time.sleep(0.05)  # parked by now
    gone = threading.Thread(target=_spin, args=(0.01,), name="gone")
    clocks = ThreadCpuClocks()
    before = clocks.sample()
    busy = threading.Thread(target=spin_then_park, name="spinner", daemon=True)
    busy.start()  # started after the first sample: counted from its start
    gone.start()
    time.sleep(SPIN_S * 1.5)
    gone.join()
    after = clocks.sample()
    release.set()
    parked.join()
    busy.join()
    used = cpu_by_thread(before, after)
    assert SPIN_S * 0.5 <= used["spinner"] <= SPIN_S * 1.5
    assert used.get("parked", 0.0) < 0.001  # parked all along: next to no CPU
    assert "gone" not in used  # ended before the second sample


def test_cpu_used_between_samples_is_counted_per_thread_and_summed_by_name() -> None:
    stop = threading.Event()

    def spin_until_stopped() -> None:
        while not stop.is_set():
            pass

    spinners = [
        threading.Thread(target=spin_until_stopped, name="worker", daemon=True) for _ in range(2)
    ]
    for thread in spinners:
        thread.start()
    try:
        clocks = ThreadCpuClocks()
        before = clocks.sample()
        _spin(SPIN_S)  # this thread spins too, and shares the GIL with both
        after = clocks.sample()
    finally:
        stop.set()
        for thread in spinners:
            thread.join()
    this = threading.get_ident()
    used = cpu_by_thread(before, after)
    assert set(used) >= {"worker", threading.current_thread().name}
    # one GIL among three spinning threads: together they ran about the whole interval
    assert sum(used.values()) >= SPIN_S * 0.6
    assert list(used.values()) == sorted(used.values(), reverse=True)  # busiest first
    assert after[this][1] - before[this][1] == pytest.approx(
        used[threading.current_thread().name]
    )
    # the thread measured elsewhere is left out by its ident
    assert threading.current_thread().name not in cpu_by_thread(before, after, leave_out=this)


def _wait_until_gone(clock: int) -> None:
    deadline_s = time.perf_counter() + 5.0
    while time.perf_counter() < deadline_s:
        try:
            time.clock_gettime(clock)
        except OSError:
            return
        time.sleep(0.001)
    raise AssertionError("the thread's CPU clock is still there 5 s after it ended")


def test_a_thread_started_as_another_ended_is_not_missed() -> None:
    clocks = ThreadCpuClocks()
    release = threading.Event()
    first = threading.Thread(target=release.wait, name="first", daemon=True)
    first.start()
    assert "first" in {name for name, _ in clocks.sample().values()}
    assert first.ident is not None
    first_clock = time.pthread_getcpuclockid(first.ident)
    release.set()
    first.join()
    _wait_until_gone(first_clock)  # join returns a moment before the OS thread has ended
    second_release = threading.Event()
    second = threading.Thread(target=second_release.wait, name="second", daemon=True)
    second.start()  # as many threads as at the last listing
    try:
        # the same count, but the first one's clock has gone: the list is made again
        names = {name for name, _ in clocks.sample().values()}
        assert "second" in names
        assert "first" not in names
    finally:
        second_release.set()
        second.join()


def test_an_ident_reused_by_a_new_thread_counts_that_thread_whole() -> None:
    before = {7: ("old", 5.0)}
    assert cpu_by_thread(before, {7: ("new", 0.25)}) == {"new": 0.25}
    assert cpu_by_thread(before, {7: ("old", 5.5)}) == {"old": pytest.approx(0.5)}
    assert cpu_by_thread({}, {}) == {}
