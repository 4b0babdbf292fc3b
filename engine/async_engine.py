"""AsyncLLMEngine: the engine loop in a thread of the caller's process (`EngineClient`).

Add and abort are commands the loop thread applies between steps. For a caller that wants the
engine beside it (a notebook, tests over a fake runner); a server that must keep its event
loop responsive runs the engine in a process of its own (`engine.engine_process`), where the
engine's Python does not contend with the loop for one GIL.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable

from engine.engine_client import EngineClient
from engine.errors import EngineError
from engine.llm_engine import LLMEngine, TenantContext
from engine.sampling_params import SamplingParams

logger = logging.getLogger(__name__)


class AsyncLLMEngine(EngineClient):
    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine.limits, engine.stats())
        self.engine = engine
        self._commands: list[Callable[[], None]] = []
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tiergate-engine", daemon=True)
        self._thread.start()

    def abort(self, request_id: str) -> None:
        self._submit(lambda: self.engine.abort(request_id))

    def record_refused(self, num_prompt_tokens: int, tenant: TenantContext) -> None:
        self._submit(lambda: self.engine.record_refused(num_prompt_tokens, tenant))

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stopped = True
        self._wake.set()
        self._thread.join(timeout_s)

    @property
    def is_running(self) -> bool:
        return not self._stopped and self._thread.is_alive() and self._error is None

    def _submit_add(
        self,
        request_id: str,
        prompt_token_ids: list[int],
        sampling_params: SamplingParams,
        tenant: TenantContext,
    ) -> None:
        def add() -> None:
            try:
                self.engine.add_request(request_id, prompt_token_ids, sampling_params, tenant)
            except EngineError as exc:  # e.g. a duplicate id: fail this caller only
                self._fail(request_id, exc)

        self._submit(add)

    def _submit(self, command: Callable[[], None]) -> None:
        with self._lock:
            self._commands.append(command)
        self._wake.set()

    # -- the loop thread -----------------------------------------------------------------------

    def _run(self) -> None:
        try:
            while not self._stopped:
                with self._lock:
                    commands, self._commands = self._commands, []
                    taken_in_at_s = time.monotonic()  # what is submitted later is not in
                for command in commands:
                    command()
                if not self.engine.has_unfinished_requests():
                    self._wake.wait(timeout=0.5)
                    self._wake.clear()
                    continue
                self._deliver(self.engine.step())
                stats = self.engine.stats()
                stats.taken_in_at_s = taken_in_at_s
                self._stats = stats
        except BaseException as exc:  # the loop itself broke: fail every open stream
            logger.exception("engine loop stopped")
            self._error = exc
            self._fail_all()
