"""FairWorker: one worker thread whose jobs take turns between keys (tenants).

Each key's jobs run in the order they came; the keys with jobs waiting are served round
robin, one job each. A tenant that queues a thousand grammar compiles then delays another
tenant's first compile by at most one compile, where one queue served first in, first out
made it wait for all thousand.
"""

from __future__ import annotations

import threading
from collections import OrderedDict, deque
from collections.abc import Callable
from concurrent.futures import Future
from typing import Any, TypeVar

from engine.errors import is_fatal

__all__ = ["FairWorker"]

T = TypeVar("T")


class FairWorker:
    """Runs submitted jobs one at a time in a daemon thread (started on first use)."""

    def __init__(self, thread_name: str) -> None:
        self._thread_name = thread_name
        # key -> its jobs in order; the order of the keys is the round robin's.
        self._queues: OrderedDict[str, deque[tuple[Callable[[], Any], Future[Any]]]] = (
            OrderedDict())
        self._condition = threading.Condition()
        self._thread: threading.Thread | None = None

    def submit(self, key: str, job: Callable[[], T]) -> Future[T]:
        """job's result (or what it raised) as a future; it runs in the key's turn."""
        future: Future[T] = Future()
        with self._condition:
            queue = self._queues.get(key)
            if queue is None:
                queue = self._queues[key] = deque()  # a new key waits one round at most
            queue.append((job, future))
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name=self._thread_name,
                                                daemon=True)
                self._thread.start()
            self._condition.notify()
        return future

    def num_queued(self, key: str) -> int:
        """Jobs of key waiting (not the one running)."""
        with self._condition:
            queue = self._queues.get(key)
            return 0 if queue is None else len(queue)

    def _next(self) -> tuple[Callable[[], Any], Future[Any]]:
        with self._condition:
            while not self._queues:
                self._condition.wait()
            key, queue = next(iter(self._queues.items()))
            job = queue.popleft()
            if queue:
                self._queues.move_to_end(key)  # its next job after every other key's
            else:
                del self._queues[key]
            return job

    def _run(self) -> None:
        while True:
            job, future = self._next()
            if not future.set_running_or_notify_cancel():
                continue
            try:
                result = job()
            except BaseException as exc:  # a native panic included: its job's future fails
                if is_fatal(exc):
                    raise
                future.set_exception(exc)
            else:
                future.set_result(result)
