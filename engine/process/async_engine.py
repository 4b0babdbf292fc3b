"""AsyncLLMEngine: the engine loop (`EngineLoop`) in a thread of the caller's process
(`EngineClient`).

For a caller that wants the engine beside it (a notebook, tests over a fake runner); a server
that must keep its event loop responsive runs the engine in a process of its own
(`engine.process.engine_process`), where the engine's Python does not contend with the loop for one
GIL.
"""

from __future__ import annotations

import logging
import threading

from engine.core.llm_engine import LLMEngine
from engine.core.scheduler_stats import SchedulerStats
from engine.process.engine_client import EngineClient
from engine.process.engine_loop import EngineCommand, EngineLoop, Stop

logger = logging.getLogger(__name__)


class AsyncLLMEngine(EngineClient):
    def __init__(self, engine: LLMEngine) -> None:
        super().__init__(engine.limits, engine.stats(), engine.runner.weight_format_label)
        self.engine = engine
        self._loop = EngineLoop(engine, self._deliver, self._set_stats, self._fail)
        self._stopped = False
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name="tiergate-engine", daemon=True)
        self._thread.start()

    def shutdown(self, timeout_s: float = 5.0) -> None:
        self._stopped = True
        self._loop.submit(Stop())
        self._thread.join(timeout_s)

    @property
    def is_running(self) -> bool:
        return not self._stopped and self._thread.is_alive() and self._error is None

    def _send(self, command: EngineCommand) -> None:
        self._loop.submit(command)

    def _set_stats(self, stats: SchedulerStats) -> None:
        self._stats = stats

    def _run(self) -> None:
        try:
            self._loop.run()
        except BaseException as exc:  # the loop itself broke: fail every open stream
            logger.exception("engine loop stopped")
            self._error = exc
            self._fail_all()
