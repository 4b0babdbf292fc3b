"""Everything one replica runs, built once at start and shared by the routes: settings,
database, key resolver, the served model and its engine, admission, and the sinks that
take each finished request (ledger, metrics, alerting).

Lifecycle: ``start`` (from the app's lifespan) loads the model off the event loop; the
replica is ready once it is loaded and the database answers. ``drain`` (SIGTERM) refuses
new requests with 503, waits for those in flight up to a deadline, then returns.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import anyio.to_thread
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

import tenants
from engine import SchedulerStats
from engine.engine_client import EngineClient
from engine.models.config import ModelConfigError
from gateway.auth import TenantKeyResolver
from gateway.errors import ServiceUnavailableError
from gateway.request_record import RequestRecord
from gateway.served_model import ServedModel, load_served_model
from gateway.settings import GatewaySettings
from gateway.telemetry import Telemetry, TelemetrySettings, setup_telemetry
from policies import TierTable

logger = logging.getLogger(__name__)


class RecordSink(Protocol):
    """Takes every finished request; the ledger's sink returns once the record is durable."""

    async def record(self, record: RequestRecord) -> None: ...


ModelLoader = Callable[[GatewaySettings, TierTable, int], tuple[ServedModel, EngineClient]]


class GatewayRuntime:
    def __init__(
        self,
        settings: GatewaySettings,
        tiers: TierTable,
        db_engine: Engine,
        *,
        model_loader: ModelLoader = load_served_model,
    ) -> None:
        self.settings = settings
        self.tiers = tiers
        self.db_engine = db_engine
        self.session_factory: sessionmaker[Session] = tenants.create_session_factory(db_engine)
        self.key_resolver = TenantKeyResolver(self.session_factory)
        self.served: ServedModel | None = None
        self.engine: EngineClient | None = None
        # Called with each finished request, in order; the first is the ledger when present.
        self.sinks: list[RecordSink] = []
        self.is_draining = False
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._model_loader = model_loader
        self._load_error: BaseException | None = None
        self._on_close: list[Callable[[], Awaitable[None]]] = []
        self._on_start: list[Callable[[], Awaitable[None]]] = []
        # Records published without waiting (refusals); close() waits for them.
        self._background: set[asyncio.Task[None]] = set()
        # Tracing of each request (no-op unless an OTLP endpoint is configured).
        self.telemetry: Telemetry = setup_telemetry(TelemetrySettings())
        # Called once the model is loaded, before the replica reports ready.
        self.on_loaded: Callable[[ServedModel], None] | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the background services, then load the model off the event loop;
        readiness follows."""
        for callback in self._on_start:
            await callback()
        created = int(time.time())
        try:
            self.served, self.engine = await anyio.to_thread.run_sync(
                self._model_loader, self.settings, self.tiers, created
            )
        except ModelConfigError as exc:  # what --model names is at fault, not the code
            self._load_error = exc
            logger.error("loading the model failed: %s", exc)
            raise
        except Exception as exc:
            self._load_error = exc
            logger.exception("loading the model failed")
            raise
        if self.on_loaded is not None and self.served is not None:
            self.on_loaded(self.served)

    def on_start(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Run callback at start, before the model loads (e.g. the alert monitor)."""
        self._on_start.append(callback)

    def on_close(self, callback: Callable[[], Awaitable[None]]) -> None:
        """Run callback at close, after the engine stopped (e.g. flush the ledger)."""
        self._on_close.append(callback)

    async def drain(self, timeout_s: float) -> bool:
        """Refuse new requests and wait for the running ones; True if all finished in time."""
        self.is_draining = True
        logger.info("draining: %d request(s) in flight", self.num_in_flight)
        try:
            await asyncio.wait_for(self._idle.wait(), timeout_s)
            return True
        except TimeoutError:
            logger.warning("drain deadline passed with %d request(s) in flight",
                           self.num_in_flight)
            return False

    async def close(self) -> None:
        if self.engine is not None:
            await anyio.to_thread.run_sync(self.engine.shutdown)
        if self._background:
            await asyncio.gather(*self._background, return_exceptions=True)
        for callback in self._on_close:
            await callback()
        await anyio.to_thread.run_sync(self.key_resolver.close)
        self.db_engine.dispose()

    # -- state the routes read -------------------------------------------------------------------

    def engine_stats(self) -> SchedulerStats:
        """The engine's latest statistics (empty before the model is loaded)."""
        return self.engine.stats() if self.engine is not None else SchedulerStats()

    @property
    def is_model_loaded(self) -> bool:
        return self.served is not None and self.engine is not None and self.engine.is_running

    def database_answers(self) -> bool:
        try:
            with self.db_engine.connect() as connection:
                connection.execute(text("SELECT 1"))
            return True
        except Exception:
            return False

    def ready_model(self) -> tuple[ServedModel, EngineClient]:
        """The model and engine for a new request, or 503 (loading, failed or draining)."""
        if self.is_draining:
            raise ServiceUnavailableError(
                "this replica is shutting down; retry on another", code="draining"
            )
        if self.served is None or self.engine is None:
            message = "the model failed to load" if self._load_error else "the model is loading"
            raise ServiceUnavailableError(message, code="model_not_ready")
        if not self.engine.is_running:
            raise ServiceUnavailableError("the engine has stopped", code="engine_dead")
        return self.served, self.engine

    # -- in-flight accounting (drain waits on it) --------------------------------------------------

    def request_started(self) -> None:
        self.num_in_flight += 1
        self._idle.clear()

    def request_ended(self) -> None:
        self.num_in_flight -= 1
        if self.num_in_flight == 0:
            self._idle.set()

    def publish_soon(self, record: RequestRecord) -> None:
        """publish() without waiting: for refusals, whose client is told nothing succeeded,
        so the 429 need not wait for the ledger's commit."""
        task = asyncio.get_running_loop().create_task(self.publish(record))
        self._background.add(task)
        task.add_done_callback(self._background.discard)

    async def publish(self, record: RequestRecord) -> None:
        """Hand a finished request to every sink; a failing sink is logged, not raised."""
        for sink in self.sinks:
            try:
                await sink.record(record)
            except Exception:
                logger.exception("record sink %s failed for %s", type(sink).__name__,
                                 record.request_id)
