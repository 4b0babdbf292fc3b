"""First come, first served: the engine's own scheduling policy (a vLLM-style baseline).

Running decodes take the budget first, then prefills in progress, then admissions in the
waiting queue's order; nobody is preempted to admit a request, and a request that cannot grow
takes the blocks of the latest admitted (possibly its own).
"""

from __future__ import annotations

from engine.core.queues import FCFSQueue, WaitingQueue
from engine.core.request import Request
from engine.core.scheduling_policy import StepBuilder


class FCFSPolicy:
    """waiting: the admission order (arrival order by default)."""

    preempts_by_priority = False
    num_lane_steps = 0

    def __init__(self, waiting: WaitingQueue | None = None) -> None:
        self.waiting: WaitingQueue = waiting if waiting is not None else FCFSQueue()

    def build_step(self, step: StepBuilder, now_s: float) -> None:
        decodes: list[Request] = []
        prefills: list[Request] = []
        for request in step.running:
            (decodes if request.is_prefill_done else prefills).append(request)
        step.run(decodes)
        step.run(prefills)
        step.admit()

    def growth_victim(self, request: Request, candidates: list[Request], step: StepBuilder
                      ) -> Request:
        return max(candidates, key=lambda r: r.admission_seq)

    def admission_victims(self, request: Request, step: StepBuilder) -> list[Request]:
        return []

    def payer(self, victim: Request, request: Request) -> Request:
        return request

    def record_sent(
        self, priority: int, tenant_id: str, weight: float, num_tokens: int, now_s: float
    ) -> None:
        return None
