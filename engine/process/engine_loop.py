"""EngineLoop: runs an LLMEngine, step after step, taking commands from other threads.

Commands (add, abort, a refused request, stop) are values, so the same loop serves a caller
in its own process (`engine.process.async_engine`: submitted directly) and one in another process
(`engine.process.engine_process`: sent down a pipe, submitted by the thread that reads it). They are
applied between steps; each step's outputs, then (at a bounded rate) its statistics, go to the
callbacks the loop was given.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from engine.core.llm_engine import LLMEngine
from engine.core.scheduler_stats import SchedulerStats
from engine.errors import EngineError
from engine.sampling_params import SamplingParams
from engine.step_outputs import StepOutputs
from engine.types import LoraRequest, TenantContext

# Least time between two statistics a running engine publishes (0: after every step).
STATS_INTERVAL_S = 0.01


@dataclass(frozen=True)
class AddRequest:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    tenant: TenantContext
    lora: LoraRequest | None = None  # the adapter it runs with


@dataclass(frozen=True)
class AbortRequest:
    request_id: str


@dataclass(frozen=True)
class RecordRefused:
    """A request refused for overload (`LLMEngine.record_refused`)."""

    num_prompt_tokens: int
    tenant: TenantContext


@dataclass(frozen=True)
class Stop:
    pass


EngineCommand = AddRequest | AbortRequest | RecordRefused | Stop


class EngineLoop:
    def __init__(
        self,
        engine: LLMEngine,
        deliver: Callable[[StepOutputs], None],
        publish_stats: Callable[[SchedulerStats], None],
        add_failed: Callable[[str, EngineError], None],
        stats_interval_s: float = STATS_INTERVAL_S,
    ) -> None:
        """deliver gets each step's outputs, publish_stats its statistics after them (with
        taken_in_at_s set; at most once per stats_interval_s while the engine has work, and
        when it runs out), add_failed the request whose add the engine refused (e.g. a
        duplicate id: only its caller fails)."""
        self.engine = engine
        self._deliver = deliver
        self._publish_stats = publish_stats
        self._add_failed = add_failed
        self._pending: list[EngineCommand] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stats_interval_s = stats_interval_s
        self._stats_published_at = float("-inf")

    def submit(self, command: EngineCommand) -> None:
        """From any thread: applied before the next step."""
        self.submit_all([command])

    def submit_all(self, commands: list[EngineCommand]) -> None:
        """From any thread: applied before the next step, in order."""
        with self._lock:
            self._pending += commands
        self._wake.set()

    def run(self) -> None:
        """Until a Stop is applied; what the engine raises outside a step propagates."""
        while True:
            with self._lock:
                commands, self._pending = self._pending, []
                taken_in_at_s = time.monotonic()  # what is submitted later is not in
            for command in commands:
                if isinstance(command, Stop):
                    return
                self._apply(command)
            if not self.engine.has_unfinished_requests():
                self._wake.wait(timeout=0.5)
                self._wake.clear()
                continue
            outputs = self.engine.step()
            if outputs:
                self._deliver(outputs)
            now = time.monotonic()
            # Statistics at a bounded rate (building them walks the running requests), and
            # always once the engine runs dry, so that its idle state is seen.
            if (now - self._stats_published_at >= self._stats_interval_s
                    or not self.engine.has_unfinished_requests()):
                stats = self.engine.stats()
                stats.taken_in_at_s = taken_in_at_s
                self._publish_stats(stats)
                self._stats_published_at = now

    def _apply(self, command: AddRequest | AbortRequest | RecordRefused) -> None:
        engine = self.engine
        if isinstance(command, AddRequest):
            try:
                engine.add_request(
                    command.request_id,
                    command.prompt_token_ids,
                    command.sampling_params,
                    command.tenant,
                    lora=command.lora,
                )
            except EngineError as exc:
                self._add_failed(command.request_id, exc)
        elif isinstance(command, AbortRequest):
            engine.abort(command.request_id)
        else:
            engine.record_refused(command.num_prompt_tokens, command.tenant)
