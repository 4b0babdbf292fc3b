"""One served model in a replica: its loading, its engine (in a process of its own), and the
supervisor that restarts that engine when its loop stops.

A host's states: loading; up; failed (its first load raised: the replica's other models serve
on, this one's requests get 503 `model_not_ready`; a load that failed for any reason but the
checkpoint itself is tried again, with a doubling wait); restarting (its engine stopped: the
requests in flight fail with an engine error and are recorded, new ones get 503
`engine_restarting`, and the model is loaded again, with a doubling wait between failed
tries). An engine down for two minutes makes `/health/live` fail so the orchestrator replaces
the replica.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import time
from collections.abc import Callable

import anyio.to_thread

from engine import EngineClient, ModelConfigError, SchedulerStats
from gateway.http.errors import ServiceUnavailableError
from gateway.observability.engine_health import (
    ENGINE_CHECK_INTERVAL_S,
    RESTART_BACKOFF_S,
    EngineHealth,
)
from gateway.server.model_spec import ModelSpec
from gateway.server.served_model import ServedModel
from gateway.server.settings import GatewaySettings
from policies import TierTable

logger = logging.getLogger(__name__)

ModelLoader = Callable[
    [GatewaySettings, TierTable, ModelSpec, int], tuple[ServedModel, EngineClient]
]


class ModelState(enum.StrEnum):
    LOADING = "loading"
    UP = "up"
    FAILED = "failed"  # its first load raised
    RESTARTING = "restarting"  # its engine stopped; being loaded again


class ModelHost:
    """One model's engine and its supervisor; the runtime holds one per served model."""

    def __init__(self, settings: GatewaySettings, tiers: TierTable, spec: ModelSpec,
                 loader: ModelLoader) -> None:
        self.settings = settings
        self.tiers = tiers
        self.spec = spec
        self.name = spec.served_name
        self.served: ServedModel | None = None
        self.engine: EngineClient | None = None
        self.load_error: BaseException | None = None
        self._loader = loader
        self._supervisor: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self._generation = 0
        self._num_restarts = 0
        self._num_failed_restarts = 0
        self._down_since: float | None = None  # time.monotonic() the engine was found down

    # -- lifecycle -------------------------------------------------------------------------------

    async def load(self) -> None:
        """Load the model off the event loop, then supervise it; raises what the load raised
        (the host is then failed, and tried again unless its checkpoint is at fault)."""
        try:
            self.served, self.engine = await self._load()
        except BaseException as exc:
            self.load_error = exc
            if isinstance(exc, ModelConfigError):  # what --model names is at fault
                logger.error("loading the model %s failed: %s", self.name, exc)
            else:
                logger.exception("loading the model %s failed", self.name)
            if isinstance(exc, Exception) and not isinstance(exc, ModelConfigError):
                self._supervisor = asyncio.get_running_loop().create_task(self._retry_load())
            raise
        self._up()

    def _up(self) -> None:
        self.load_error = None
        self._generation = 1
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())

    async def close(self) -> None:
        self._closing.set()
        if self._supervisor is not None:  # a restart under way finishes, then is shut down
            await self._supervisor
        if self.engine is not None:
            await anyio.to_thread.run_sync(self.engine.shutdown)

    async def _load(self) -> tuple[ServedModel, EngineClient]:
        return await anyio.to_thread.run_sync(
            self._loader, self.settings, self.tiers, self.spec, int(time.time())
        )

    # -- state the routes read -------------------------------------------------------------------

    @property
    def state(self) -> ModelState:
        if self._down_since is not None or (self.engine is not None
                                             and not self.engine.is_running):
            return ModelState.RESTARTING
        if self.served is not None and self.engine is not None:
            return ModelState.UP
        return ModelState.FAILED if self.load_error is not None else ModelState.LOADING

    @property
    def is_up(self) -> bool:
        return self.state is ModelState.UP

    @property
    def is_settled(self) -> bool:
        """Loaded once, or failed: no longer in its first load."""
        return self.state is not ModelState.LOADING

    def health(self) -> EngineHealth:
        return EngineHealth(
            is_up=self.is_up,
            generation=self._generation,
            num_restarts=self._num_restarts,
            num_failed_restarts=self._num_failed_restarts,
            down_for_s=(
                None if self._down_since is None else time.monotonic() - self._down_since
            ),
        )

    def stats(self) -> SchedulerStats:
        """The engine's latest statistics (empty before the model is loaded)."""
        return self.engine.stats() if self.engine is not None else SchedulerStats()

    def ready(self) -> tuple[ServedModel, EngineClient]:
        """The model and engine for a new request, or 503 (loading, failed, restarting)."""
        state = self.state
        if state is ModelState.RESTARTING:
            raise ServiceUnavailableError(
                f"the engine of {self.name!r} stopped and is being restarted; retry shortly",
                code="engine_restarting",
            )
        if self.served is None or self.engine is None:
            message = (f"the model {self.name!r} failed to load" if self.load_error
                       else f"the model {self.name!r} is loading")
            raise ServiceUnavailableError(message, code="model_not_ready")
        return self.served, self.engine

    # -- supervision -------------------------------------------------------------------------------

    async def _retry_load(self) -> None:
        """After a failed first load: load again, with a doubling wait, until it loads."""
        backoff_s = RESTART_BACKOFF_S[0]
        while not await self._closed_within(backoff_s):
            try:
                served, engine = await self._load()
            except Exception as exc:
                self.load_error = exc
                logger.error("loading the model %s failed again (%s); next try in %.0f s",
                             self.name, exc, min(2 * backoff_s, RESTART_BACKOFF_S[1]))
                backoff_s = min(2 * backoff_s, RESTART_BACKOFF_S[1])
                continue
            if self._closing.is_set():
                await anyio.to_thread.run_sync(engine.shutdown)
                return
            self.served, self.engine = served, engine
            logger.warning("the model %s is loaded after failed tries", self.name)
            self._up()
            return

    async def _supervise(self) -> None:
        """Restart the engine whenever its loop has stopped, until close()."""
        backoff_s = RESTART_BACKOFF_S[0]
        while not await self._closed_within(ENGINE_CHECK_INTERVAL_S):
            engine = self.engine
            if engine is None or engine.is_running:
                continue
            if self._down_since is None:
                self._down_since = time.monotonic()
                logger.error("the engine of %s stopped: restarting it", self.name)
                await anyio.to_thread.run_sync(engine.shutdown)  # its process, pipes, threads
            try:
                served, restarted = await self._load()
            except Exception:
                self._num_failed_restarts += 1
                logger.exception("restarting the engine of %s failed; next try in %.0f s",
                                 self.name, backoff_s)
                if await self._closed_within(backoff_s):
                    return
                backoff_s = min(2 * backoff_s, RESTART_BACKOFF_S[1])
                continue
            if self._closing.is_set():  # close() came while it loaded
                await anyio.to_thread.run_sync(restarted.shutdown)
                return
            down_for_s = time.monotonic() - self._down_since
            self.served, self.engine = served, restarted
            self._generation += 1
            self._num_restarts += 1
            self._down_since = None
            backoff_s = RESTART_BACKOFF_S[0]
            logger.warning("the engine of %s was restarted after %.1f s", self.name, down_for_s)

    async def _closed_within(self, seconds: float) -> bool:
        """Wait up to seconds; True as soon as close() has begun."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closing.wait(), seconds)
        return self._closing.is_set()
