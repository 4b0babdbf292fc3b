"""The CPU time of each of this process's Python threads, read from another thread.

Only a thread that holds the GIL runs Python, so while the event loop thread waits for it,
some other Python thread is on a CPU. Sampled before and after a stall, the threads whose CPU
time grew are the ones that ran meanwhile: the one that held the GIL is among them (one can
also have run C code that let the GIL go, as torch's kernels do). The process's threads that
Python did not start (torch's compute pool) are not listed: they never hold the GIL.

A read is one ``clock_gettime`` of each thread's CPU clock; the list of clocks is made again
when the number of threads has changed or a clock has gone with its thread (so a thread
that started as another ended is not missed). Where the platform has no per-thread CPU
clocks, a sample is empty. Sampled at every beat of the event loop's heartbeat
(gateway.observability.loop_lag), with ten threads, it costs an idle process a fraction of
a percent of a core (ops/bench/journal.md, "Runs 69-72").
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping

__all__ = ["ThreadCpuClocks", "ThreadCpuSample", "cpu_by_thread"]

# thread ident -> (its name, its CPU seconds so far)
ThreadCpuSample = Mapping[int, tuple[str, float]]


class ThreadCpuClocks:
    """Samples every live Python thread's CPU time."""

    def __init__(self) -> None:
        self._num_threads = -1  # how many threads there were when the list was made
        self._clocks: list[tuple[int, str, int]] = []  # (ident, name, CPU clock id)

    def sample(self) -> ThreadCpuSample:
        """Each Python thread's CPU seconds so far. A thread absent from an earlier sample
        started after it; one that ends while read is left out."""
        if not hasattr(time, "pthread_getcpuclockid"):
            return {}
        if threading.active_count() != self._num_threads:
            self._list_clocks()
        sample, is_complete = self._read()
        if not is_complete:  # one ended: another may have started in its place
            self._list_clocks()
            sample, _ = self._read()
        return sample

    def _read(self) -> tuple[dict[int, tuple[str, float]], bool]:
        """The listed threads' CPU times, and whether every one was still there."""
        sample: dict[int, tuple[str, float]] = {}
        for ident, name, clock in self._clocks:
            try:
                sample[ident] = (name, time.clock_gettime(clock))
            except OSError:  # ended since it was listed
                continue
        return sample, len(sample) == len(self._clocks)

    def _list_clocks(self) -> None:
        threads = threading.enumerate()
        self._num_threads = len(threads)
        self._clocks = []
        for thread in threads:
            if thread.ident is None:  # not started yet
                continue
            try:
                clock = time.pthread_getcpuclockid(thread.ident)
            except OSError:  # ended between the listing and here
                continue
            self._clocks.append((thread.ident, thread.name, clock))


def cpu_by_thread(
    before: ThreadCpuSample, after: ThreadCpuSample, *, leave_out: int | None = None
) -> dict[str, float]:
    """CPU seconds each thread used between two samples, by name (threads of one name
    summed; one started in between counts from its start), busiest first; threads that used
    none, and ``leave_out``, are not listed."""
    used: dict[str, float] = {}
    for ident, (name, cpu_s) in after.items():
        if ident == leave_out:
            continue
        earlier = before.get(ident)
        # an ident reused by a thread started in between is a new thread: count it whole
        if earlier is not None and earlier[0] == name and earlier[1] <= cpu_s:
            start_s = earlier[1]
        else:
            start_s = 0.0
        if cpu_s > start_s:
            used[name] = used.get(name, 0.0) + cpu_s - start_s
    return dict(sorted(used.items(), key=lambda item: -item[1]))
