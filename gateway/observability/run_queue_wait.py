"""How long one thread has waited, ready to run, for a CPU: Linux's run-queue wait.

A thread that is runnable but not running (its process's other threads, or other processes,
have the CPUs) adds to the second field of ``/proc/<pid>/task/<tid>/schedstat``, in
nanoseconds, since the thread began. A thread asleep (on I/O, a lock, the GIL) does not. So
the difference over an interval tells a thread that could not get a CPU from one that was
held some other way. The file stays open and is re-read from its start (a cheap read:
ops/bench/journal.md, "Runs 62-68"); where the kernel does not have it (not Linux, schedstat
not built in) every read is None.
"""

from __future__ import annotations

import contextlib
import os
import threading

__all__ = ["RunQueueWait"]

_NS_PER_S = 1e9


class RunQueueWait:
    """The calling thread's run-queue wait so far; make it on the thread it measures."""

    def __init__(self) -> None:
        path = f"/proc/self/task/{threading.get_native_id()}/schedstat"
        self._fd: int | None
        try:
            self._fd = os.open(path, os.O_RDONLY)
        except OSError:
            self._fd = None
        if self.total_s() is None:
            self.close()

    def total_s(self) -> float | None:
        """Seconds the thread has been ready to run without a CPU since it began; None
        where not reported."""
        if self._fd is None:
            return None
        try:
            fields = os.pread(self._fd, 128, 0).split()
            return int(fields[1]) / _NS_PER_S
        except (OSError, IndexError, ValueError):
            return None

    def close(self) -> None:
        fd, self._fd = self._fd, None
        if fd is not None:
            with contextlib.suppress(OSError):
                os.close(fd)
