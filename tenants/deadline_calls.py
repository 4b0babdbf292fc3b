"""Blocking database calls with a deadline of their own, for a database that accepts
connections and never answers (stopped, partitioned): no server-side limit (lock, statement)
can fire there, and `connect_timeout` covers only new connections.

Each call runs on a daemon thread of its own (one stuck there cannot keep the process from
exiting); its caller waits at most its deadline, then gets CallTimedOut while the call goes
on, told through the event it was given that nobody waits for it any more. While `max_stuck`
such calls still run, no new one starts (CallTimedOut at once), so a dead database holds a
bounded number of threads and connections.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import threading
from collections.abc import Callable
from typing import TypeVar

_T = TypeVar("_T")

# call(abandoned): abandoned is set once its caller has stopped waiting.
DeadlineCall = Callable[[threading.Event], _T]


class CallTimedOut(TimeoutError):
    """No answer within the deadline, or too many earlier calls still unanswered."""


class DeadlineCalls:
    """Runs blocking calls with a deadline, at most max_stuck of them past it at once."""

    def __init__(self, name: str, max_stuck: int) -> None:
        self._name = name  # the threads' name
        self._max_stuck = max_stuck
        self._lock = threading.Lock()
        self._num_stuck = 0

    @property
    def num_stuck(self) -> int:
        """Calls still running after their caller stopped waiting for them."""
        with self._lock:
            return self._num_stuck

    def call(self, call: DeadlineCall[_T], timeout_s: float) -> _T:
        """call(abandoned) from a thread that may block."""
        future, abandon = self._start(call)
        try:
            return future.result(timeout=timeout_s)
        except concurrent.futures.TimeoutError:
            abandon()
            raise CallTimedOut(f"no answer within {timeout_s} s") from None

    async def acall(self, call: DeadlineCall[_T], timeout_s: float) -> _T:
        """call(abandoned) awaited on the event loop."""
        future, abandon = self._start(call)
        try:
            return await asyncio.wait_for(asyncio.wrap_future(future), timeout_s)
        except TimeoutError:
            abandon()
            raise CallTimedOut(f"no answer within {timeout_s} s") from None

    def _start(
        self, call: DeadlineCall[_T]
    ) -> tuple[concurrent.futures.Future[_T], Callable[[], None]]:
        with self._lock:
            if self._num_stuck >= self._max_stuck:
                raise CallTimedOut(f"{self._num_stuck} earlier calls have not returned")
        abandoned = threading.Event()
        state = {"done": False, "stuck": False}
        future: concurrent.futures.Future[_T] = concurrent.futures.Future()
        future.set_running_or_notify_cancel()  # a waiter's cancel cannot cancel it now

        def run() -> None:
            try:
                future.set_result(call(abandoned))
            except BaseException as exc:
                future.set_exception(exc)
            finally:
                with self._lock:
                    state["done"] = True
                    if state["stuck"]:
                        self._num_stuck -= 1

        def abandon() -> None:
            abandoned.set()
            with self._lock:
                if not state["done"]:
                    state["stuck"] = True
                    self._num_stuck += 1

        threading.Thread(target=run, name=self._name, daemon=True).start()
        return future, abandon
