"""How late the event loop runs, and what the process was doing when it stalled.

Every 429, every token written to a stream and every admission check is a callback on the
one asyncio event loop; while that loop is held they all wait, and the client sees it as a
slow refusal or a token gap. It can be held by a slow callback, by a garbage collection, by
another thread's Python holding the GIL (a tokenizer worker, the thread reading the engine
process's outputs; the engine's own steps run in a process of their own), or by the process
not being scheduled at all.

A heartbeat task sleeps ``tick_s`` at a time and measures how late it wakes: that lateness
is what any callback due then waited, observed into ``tiergate_event_loop_lag_seconds``. A
wake-up ``stall_s`` or more late (by default the 50 ms a refusal is allowed) is a stall,
reported (logged at WARNING, at most one record per ``log_every_s``) with what tells its
causes apart: the loop thread's own CPU time over it (a slow callback runs on the loop
thread), the time the loop thread was ready to run but had no CPU (the kernel's run-queue
wait, where Linux reports it: the process was not scheduled beside its other threads or
other processes), the whole process's CPU time and each other Python thread's (a loop
thread neither running nor waiting for a CPU waited for the GIL: the thread that held it is
one of those that ran) and the collector's pauses in it; and, taken by a watcher thread once
the beat was overdue, where each busy thread was. Frames are file, line and function names
only: no arguments or locals, so nothing secret.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import sys
import threading
import time
import traceback
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from gateway.observability.gc_pauses import GcPauses, process_gc_pauses
from gateway.observability.run_queue_wait import RunQueueWait
from gateway.observability.thread_cpu import ThreadCpuClocks, cpu_by_thread

__all__ = [
    "LAG_BUCKETS_S",
    "LoopLagWatch",
    "LoopStall",
    "StallLog",
]

logger = logging.getLogger(__name__)

# From timer jitter to multi-second stalls; 0.05 is the bound on a refusal's answer.
LAG_BUCKETS_S = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.25, 0.5, 1.0, 2.5)
# 100 wake-ups a second. An idle process doing only this uses as much CPU as a bare
# asyncio.sleep(0.01) loop: the price of any 100 Hz timer; a busy loop is awake anyway.
DEFAULT_TICK_S = 0.01
# The bound on a refusal's answer: a stall this long is one that a refusal can miss it by.
DEFAULT_STALL_S = 0.05
DEFAULT_LOG_EVERY_S = 10.0
NUM_STACK_FRAMES = 8  # innermost frames kept per thread


@dataclass(frozen=True)
class LoopStall:
    """One heartbeat that woke ``late_s`` late; CPU and collector times cover its whole
    beat (``late_s`` plus the tick it slept)."""

    late_s: float
    loop_cpu_s: float  # the event loop thread's own CPU time
    process_cpu_s: float  # every thread's of this process
    gc_s: float  # the cyclic collector's pauses
    # the loop thread's time ready to run but not running (run-queue wait); None where the
    # kernel does not report it
    loop_waiting_s: float | None = None
    # Every other Python thread that ran: its name -> its CPU time, busiest first
    threads_cpu_s: Mapping[str, float] = field(default_factory=dict)
    # Thread name -> its innermost frames, outermost first, taken while the stall lasted;
    # the loop thread's always, other threads' unless they were idle.
    stacks: Mapping[str, tuple[str, ...]] = field(default_factory=dict)

    def times(self) -> str:
        """What tells the causes apart, in a line: the loop thread's CPU time, its wait for
        a CPU (where reported), the process's CPU time and the other Python threads' that
        reached a millisecond, the collector's pauses."""
        waiting = (
            ""
            if self.loop_waiting_s is None
            else f", waiting for a CPU {self.loop_waiting_s * 1e3:.0f} ms"
        )
        threads = ", ".join(
            f"{name} {cpu_s * 1e3:.0f} ms"
            for name, cpu_s in self.threads_cpu_s.items()
            if round(cpu_s * 1e3) >= 1
        )
        of_it = f" (Python threads: {threads})" if threads else ""
        return (
            f"its thread on CPU {self.loop_cpu_s * 1e3:.0f} ms{waiting}, the process "
            f"{self.process_cpu_s * 1e3:.0f} ms{of_it}, garbage collection "
            f"{self.gc_s * 1e3:.0f} ms"
        )

    def describe(self) -> str:
        text = f"event loop stalled {self.late_s * 1e3:.0f} ms ({self.times()})"
        if not self.stacks:
            return text + "; no thread caught during it"
        parts = [f"{name}: {' > '.join(frames)}" for name, frames in self.stacks.items()]
        return text + "; " + "; ".join(parts)


class StallLog:
    """Logs stalls at WARNING, at most one record per ``every_s``; the next record counts
    the ones left out meanwhile."""

    def __init__(
        self, every_s: float = DEFAULT_LOG_EVERY_S, clock: Callable[[], float] = time.monotonic
    ) -> None:
        self.every_s = every_s
        self._clock = clock
        self._last_s: float | None = None
        self._num_left_out = 0

    def __call__(self, stall: LoopStall) -> None:
        now = self._clock()
        if self._last_s is not None and now - self._last_s < self.every_s:
            self._num_left_out += 1
            return
        left_out = (
            f" ({self._num_left_out} more since the last record)" if self._num_left_out else ""
        )
        logger.warning("%s%s", stall.describe(), left_out)
        self._last_s = now
        self._num_left_out = 0


class LoopLagWatch:
    """The heartbeat on the running loop and the watcher thread; ``start`` and ``stop`` from
    that loop."""

    def __init__(
        self,
        observe_lag: Callable[[float], None],
        *,
        tick_s: float = DEFAULT_TICK_S,
        stall_s: float = DEFAULT_STALL_S,
        on_stall: Callable[[LoopStall], None] | None = None,
        gc_pauses: GcPauses | None = None,
    ) -> None:
        if tick_s <= 0 or stall_s <= 0:
            raise ValueError("tick_s and stall_s must be > 0")
        self.tick_s = tick_s
        self.stall_s = stall_s
        self._observe_lag = observe_lag
        self._on_stall = on_stall or StallLog()
        self._gc_pauses = gc_pauses or process_gc_pauses()
        # (beat number, when its sleep began): one attribute, so the watcher reads a pair
        # the heartbeat wrote together.
        self._beat: tuple[int, float] = (0, time.perf_counter())
        # (beat number, stacks) taken by the watcher during that beat's stall
        self._caught: tuple[int, dict[str, tuple[str, ...]]] | None = None
        self._loop_thread_id: int | None = None
        self._loop_waiting: RunQueueWait | None = None
        self._thread_clocks = ThreadCpuClocks()
        self._task: asyncio.Task[None] | None = None
        self._thread: threading.Thread | None = None
        self._stopping = threading.Event()

    async def start(self) -> None:
        if self._task is not None:
            return
        self._loop_thread_id = threading.get_ident()
        self._loop_waiting = RunQueueWait()
        self._beat = (0, time.perf_counter())  # the watcher measures from now, not from __init__
        self._stopping.clear()
        self._task = asyncio.create_task(self._heartbeat(), name="tiergate-loop-heartbeat")
        self._thread = threading.Thread(
            target=self._watch, name="tiergate-loop-watch", daemon=True
        )
        self._thread.start()

    async def stop(self) -> None:
        task, thread = self._task, self._thread
        self._task = self._thread = None
        self._stopping.set()
        if task is not None:
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await task
        if thread is not None:
            thread.join()
        if self._loop_waiting is not None:
            self._loop_waiting.close()
            self._loop_waiting = None

    # -- the loop thread -------------------------------------------------------------------------

    async def _heartbeat(self) -> None:
        number = 0
        while True:
            number += 1
            began_s = time.perf_counter()
            self._beat = (number, began_s)
            loop_cpu_s, process_cpu_s = time.thread_time(), time.process_time()
            gc_s = self._gc_total_s()
            threads_cpu = self._thread_clocks.sample()
            # Last: its read lets the GIL go, and a thread that takes it then stalls this
            # beat here, after the figures above were read and before its own (the read
            # comes first, then the wait for the GIL).
            loop_waiting_s = self._loop_waiting_s()
            await asyncio.sleep(self.tick_s)
            late_s = max(0.0, time.perf_counter() - began_s - self.tick_s)
            self._observe_lag(late_s)
            if late_s < self.stall_s:
                continue
            caught = self._caught
            waited_s = self._loop_waiting_s()
            self._on_stall(
                LoopStall(
                    late_s=late_s,
                    loop_cpu_s=time.thread_time() - loop_cpu_s,
                    process_cpu_s=time.process_time() - process_cpu_s,
                    gc_s=self._gc_total_s() - gc_s,
                    loop_waiting_s=(
                        None
                        if waited_s is None or loop_waiting_s is None
                        else waited_s - loop_waiting_s
                    ),
                    threads_cpu_s=cpu_by_thread(
                        threads_cpu, self._thread_clocks.sample(), leave_out=self._loop_thread_id
                    ),
                    stacks=caught[1] if caught is not None and caught[0] == number else {},
                )
            )

    def _gc_total_s(self) -> float:
        return sum(self._gc_pauses.sums_s)

    def _loop_waiting_s(self) -> float | None:
        return None if self._loop_waiting is None else self._loop_waiting.total_s()

    # -- the watcher thread ----------------------------------------------------------------------

    def _watch(self) -> None:
        # Sleeps until the beat in progress would be a stall, then looks once: a beat that
        # ended meanwhile gives the next deadline, one still running is caught as it turns
        # into a stall. So the watcher takes the GIL (from another thread, as like as not)
        # at most about once per tick_s + stall_s (fewer times while the process is busy),
        # not once per heartbeat, and never misses the moment by a polling period.
        number, began_s = self._beat
        while not self._stopping.wait(
            max(0.0, began_s + self.tick_s + self.stall_s - time.perf_counter())
        ):
            now_number, now_began_s = self._beat
            if now_number != number:  # that beat ended; wait for the one in progress
                number, began_s = now_number, now_began_s
                continue
            caught = self._caught
            if caught is None or caught[0] != number:
                self._caught = (number, self._stacks())
            began_s = time.perf_counter()  # the same beat still: look again a stall later

    def _stacks(self) -> dict[str, tuple[str, ...]]:
        names = {thread.ident: thread.name for thread in threading.enumerate()}
        stacks: dict[str, tuple[str, ...]] = {}
        for ident, frame in sys._current_frames().items():
            if ident == threading.get_ident():
                continue
            summary = traceback.extract_stack(frame, limit=NUM_STACK_FRAMES)
            is_loop = ident == self._loop_thread_id
            if not is_loop and summary and Path(summary[-1].filename).name == "threading.py":
                continue  # parked on a lock or condition: idle
            name = "event loop" if is_loop else names.get(ident, str(ident))
            stacks[name] = tuple(
                f"{Path(entry.filename).name}:{entry.lineno} {entry.name}" for entry in summary
            )
        return stacks
