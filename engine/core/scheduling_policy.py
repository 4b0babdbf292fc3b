"""The seam between the scheduler's mechanism and a scheduling policy.

The scheduler (`engine.core.scheduler`) owns the mechanism: the token budget, allocation of KV
blocks, preemption by recompute, chunking, forks and the step's output. A policy owns the
choices: the waiting queue's order, in which order the running requests and admissions take
the step's budget, who gives up blocks for whom, and who pays for a recompute. The engine
ships FCFS (`engine.core.fcfs_policy`); the tiered, fair-sharing policy is `policies.TieredPolicy`.
"""

from __future__ import annotations

from collections.abc import Iterable, Mapping, Sequence
from contextlib import AbstractContextManager
from enum import Enum
from typing import Protocol

from engine.core.queues import WaitingQueue
from engine.core.request import Request


class Verdict(Enum):
    """An admission gate's answer for the waiting request at the head of the queue."""

    ADMIT = "admit"  # try to admit it now
    PASS = "pass"  # leave it (and the rest of its tenant's queue) for this pass
    STOP = "stop"  # end the pass


class AdmissionGate(Protocol):
    """Which waiting requests one admission pass may take (`StepBuilder.admit`)."""

    def consider(self, request: Request) -> Verdict: ...

    def admitted(self, request: Request) -> None:
        """request joined the running batch."""
        ...


class StepBuilder(Protocol):
    """What a policy may do while the scheduler builds one step."""

    @property
    def running(self) -> Sequence[Request]:
        """The running requests, in admission order (live: admissions append to it)."""
        ...

    @property
    def num_steps(self) -> int:
        """Steps built before this one."""
        ...

    @property
    def budget(self) -> int:
        """Tokens left in the step."""
        ...

    @property
    def scheduled(self) -> Mapping[str, int]:
        """Tokens scheduled so far by request id."""
        ...

    @property
    def short_of_blocks(self) -> bool:
        """A running request could not grow in place and another gave up blocks for it."""
        ...

    def blocks_held(self, request: Request) -> int: ...

    def run(self, requests: Iterable[Request]) -> None:
        """Schedule the next chunk of each running request, in this order, while the budget
        lasts (a request preempted or scheduled earlier in the step is passed over)."""
        ...

    def admit(self, gate: AdmissionGate | None = None) -> None:
        """Admit waiting requests in queue order while the budget, the batch's places and
        the KV blocks last; gate: which of them this pass may take (None: all)."""
        ...

    def capped(self, max_tokens: int) -> AbstractContextManager[None]:
        """Inside the block the step spends at most max_tokens more of its budget; the rest
        is there again after it."""
        ...


class SchedulingPolicy(Protocol):
    """The choices the scheduler leaves to a policy."""

    waiting: WaitingQueue
    # Whether requests of a more important class (lower priority) preempt the others: the
    # queue-wait estimate then counts only work of its own and more important classes.
    preempts_by_priority: bool
    num_lane_steps: int  # steps ended early to carry only part of the work (0: never)

    def build_step(self, step: StepBuilder, now_s: float) -> None:
        """Spend the step's budget: running requests and admissions, in the policy's order.
        now_s: the engine's clock."""
        ...

    def growth_victim(self, request: Request, candidates: list[Request], step: StepBuilder
                      ) -> Request:
        """Which of candidates (running requests whose blocks could make room; request
        among them) gives up its blocks so request can grow; request itself gives way."""
        ...

    def admission_victims(self, request: Request, step: StepBuilder) -> list[Request]:
        """Running requests a waiting request may preempt to get in, best victim first."""
        ...

    def payer(self, victim: Request, request: Request) -> Request:
        """Whose tenant is charged the victim's recompute when request preempts it to get in."""
        ...

    def record_sent(
        self, priority: int, tenant_id: str, weight: float, num_tokens: int, now_s: float
    ) -> None:
        """A request sent (admitted to the engine, or refused for overload)."""
        ...
