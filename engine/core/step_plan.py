"""One step while the scheduler builds it: the budget left, the chunks so far, and the
`StepBuilder` its policy spends them through."""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field

from engine.core.kv_cache.kv_manager import KVCacheManager
from engine.core.request import Request
from engine.core.scheduling_policy import AdmissionGate


@dataclass
class StepPlan:
    budget: int  # tokens left in this step
    running: Sequence[Request]  # the scheduler's running requests (live)
    num_steps: int  # steps built before this one
    kv: KVCacheManager
    _run: Callable[[Iterable[Request], StepPlan], None]
    _admit: Callable[[StepPlan, AdmissionGate | None], None]
    num_new_tokens: dict[str, int] = field(default_factory=dict)  # request id -> chunk length
    # A running request could not grow and a request gave up its blocks for it.
    short_of_blocks: bool = False
    # Most important class whose waiting head found no place in the batch or no KV blocks.
    blocked_priority: int | None = None

    def block(self, priority: int) -> None:
        if self.blocked_priority is None or priority < self.blocked_priority:
            self.blocked_priority = priority

    # -- the StepBuilder protocol --------------------------------------------------------------

    @property
    def scheduled(self) -> Mapping[str, int]:
        return self.num_new_tokens

    def blocks_held(self, request: Request) -> int:
        return self.kv.num_blocks_held(request.request_id)

    def run(self, requests: Iterable[Request]) -> None:
        self._run(requests, self)

    def admit(self, gate: AdmissionGate | None = None) -> None:
        self._admit(self, gate)

    @contextlib.contextmanager
    def capped(self, max_tokens: int) -> Iterator[None]:
        held_back = max(0, self.budget - max_tokens)
        self.budget -= held_back
        try:
            yield
        finally:
            self.budget += held_back
