"""Waiting-queue orderings behind one interface; the scheduler picks admissions through it.

The engine ships FCFS (one queue, arrival order: the baseline of a vLLM-style engine). The
tier-aware fair-share ordering lives in policies.fair_queue and plugs in here.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Protocol

from engine.core.request import Request


class WaitingQueue(Protocol):
    """Requests waiting for admission, in the policy's order."""

    def add(self, request: Request) -> None:
        """A new arrival."""
        ...

    def prepend(self, request: Request) -> None:
        """A preempted request: back at the head of its class, keeping its arrival time."""
        ...

    def remove(self, request: Request) -> None:
        """Admitted or aborted."""
        ...

    def peek(self, skip_tenants: set[str]) -> Request | None:
        """The next request to admit, ignoring tenants in skip_tenants; None if none."""
        ...

    def on_service(self, request: Request, num_input_tokens: int, num_output_tokens: int) -> None:
        """Tokens processed for a request (fair-share orderings count them)."""
        ...

    def __len__(self) -> int: ...

    def __iter__(self) -> Iterator[Request]: ...


class FCFSQueue:
    """Arrival order, no tiers: preempted requests go back to the very front."""

    def __init__(self) -> None:
        self._queue: deque[Request] = deque()

    def add(self, request: Request) -> None:
        self._queue.append(request)

    def prepend(self, request: Request) -> None:
        self._queue.appendleft(request)

    def remove(self, request: Request) -> None:
        self._queue.remove(request)

    def peek(self, skip_tenants: set[str]) -> Request | None:
        for request in self._queue:
            if request.tenant_id not in skip_tenants:
                return request
        return None

    def on_service(self, request: Request, num_input_tokens: int, num_output_tokens: int) -> None:
        return None

    def __len__(self) -> int:
        return len(self._queue)

    def __iter__(self) -> Iterator[Request]:
        return iter(self._queue)
