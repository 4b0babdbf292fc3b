"""Everything one replica runs, built once at start and shared by the routes: settings,
database, key resolver, the served model and its engine, admission, and the sinks that
take each finished request (ledger, metrics, alerting).

Lifecycle: ``start`` (from the app's lifespan) loads the model off the event loop; the
replica is ready once it is loaded. A supervisor then watches the engine: when its loop stops
(its process killed, out of memory, a crash), the requests in flight fail with an engine
error and are recorded, new ones get 503 ``engine_restarting``, and the model is loaded again,
with a doubling wait between failed tries; an engine down for two minutes makes
``/health/live`` fail so the orchestrator replaces the replica. ``drain`` (SIGTERM) refuses
new requests with 503, waits for those in flight up to a deadline, then returns.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import time
from collections.abc import Awaitable, Callable
from typing import Protocol

import anyio.to_thread
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

import tenants
from engine import EngineClient, ModelConfigError, SchedulerStats
from gateway.access.auth import TenantKeyResolver
from gateway.adapters import AdapterRegistry, AdapterStore
from gateway.http.errors import ServiceUnavailableError
from gateway.observability.engine_health import (
    ENGINE_CHECK_INTERVAL_S,
    RESTART_BACKOFF_S,
    EngineHealth,
)
from gateway.observability.telemetry import Telemetry, TelemetrySettings, setup_telemetry
from gateway.openai.request_record import RequestEnd, RequestRecord
from gateway.server.served_model import ServedModel, load_served_model
from gateway.server.settings import GatewaySettings
from policies import TierTable

logger = logging.getLogger(__name__)

# What a client gets when its request's record could not be written (service unavailable).
RECORD_LOST_STATUS = 503
# How long close() waits, once the engine has stopped, for the requests in flight to end and
# publish their records.
CLOSE_RECORDS_TIMEOUT_S = 10.0


class RecordSink(Protocol):
    """Takes every finished request; the ledger's sink returns once the record is durable
    (a refusal's once it is counted: refusals are written a second at a time)."""

    async def record(self, record: RequestRecord) -> None: ...


class RecordLostError(Exception):
    """The ledger could not make a request's record durable (database down and the spool
    unwritable): its client must not be told that the request succeeded."""


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
        # LoRA adapters: what a request's `model` names for its tenant (the database's
        # registry), their files written under the model cache on first use.
        self.adapters = AdapterRegistry(
            self.session_factory, AdapterStore(settings.model_cache_dir / "adapters"),
            max_rank=settings.max_lora_rank, max_bytes=settings.max_adapter_bytes,
            serves_adapters=settings.max_loras > 0,
        )
        self.served: ServedModel | None = None
        self.engine: EngineClient | None = None
        # Takes each finished request first; when it fails, the client hears of it.
        self.ledger: RecordSink | None = None
        # Then these (metrics, alerting), in order: a failure is logged.
        self.sinks: list[RecordSink] = []
        self.is_draining = False
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._model_loader = model_loader
        self._load_error: BaseException | None = None
        self._on_close: list[Callable[[], Awaitable[None]]] = []
        self._on_start: list[Callable[[], Awaitable[None]]] = []
        # Tracing of each request (no-op unless an OTLP endpoint is configured).
        self.telemetry: Telemetry = setup_telemetry(TelemetrySettings())
        # Called once the model is loaded, before the replica reports ready.
        self.on_loaded: Callable[[ServedModel], None] | None = None
        # The engine's supervisor (started once the model is loaded) and what it saw.
        self._supervisor: asyncio.Task[None] | None = None
        self._closing = asyncio.Event()
        self._generation = 0
        self._num_restarts = 0
        self._num_failed_restarts = 0
        self._down_since: float | None = None  # time.monotonic() the engine was found down

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
        self._generation = 1
        if self.on_loaded is not None and self.served is not None:
            self.on_loaded(self.served)
        self._supervisor = asyncio.get_running_loop().create_task(self._supervise())

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
        self._closing.set()
        if self._supervisor is not None:  # a restart under way finishes, then is shut down
            await self._supervisor
        if self.engine is not None:
            await anyio.to_thread.run_sync(self.engine.shutdown)
        # With the engine stopped, the requests still in flight end at once (an engine
        # error); their records are published before the sinks and the ledger close.
        try:
            await asyncio.wait_for(self._idle.wait(), CLOSE_RECORDS_TIMEOUT_S)
        except TimeoutError:
            logger.error("%d request(s) still unrecorded at close", self.num_in_flight)
        for callback in self._on_close:
            await callback()
        await anyio.to_thread.run_sync(self.key_resolver.close)
        self.db_engine.dispose()

    # -- state the routes read -------------------------------------------------------------------

    def engine_health(self) -> EngineHealth:
        return EngineHealth(
            is_up=self.is_model_loaded,
            generation=self._generation,
            num_restarts=self._num_restarts,
            num_failed_restarts=self._num_failed_restarts,
            down_for_s=(
                None if self._down_since is None else time.monotonic() - self._down_since
            ),
        )

    def engine_stats(self) -> SchedulerStats:
        """The engine's latest statistics (empty before the model is loaded)."""
        return self.engine.stats() if self.engine is not None else SchedulerStats()

    @property
    def is_model_loaded(self) -> bool:
        return self.served is not None and self.engine is not None and self.engine.is_running

    def database_answers(self) -> bool:
        """Whether the database answers a read of a table (SQLite's SELECT 1 would answer
        through a lock that stops every real query)."""
        try:
            with self.db_engine.connect() as connection:
                connection.execute(text("SELECT 1 FROM tenants LIMIT 1"))
            return True
        except Exception:
            return False

    def ready_model(self) -> tuple[ServedModel, EngineClient]:
        """The model and engine for a new request, or 503 (loading, failed or draining)."""
        if self.is_draining:
            raise ServiceUnavailableError(
                "this replica is shutting down; retry on another", code="draining"
            )
        if self._down_since is not None or (self.engine is not None
                                             and not self.engine.is_running):
            raise ServiceUnavailableError(
                "the engine stopped and is being restarted; retry shortly",
                code="engine_restarting",
            )
        if self.served is None or self.engine is None:
            message = "the model failed to load" if self._load_error else "the model is loading"
            raise ServiceUnavailableError(message, code="model_not_ready")
        return self.served, self.engine

    # -- the engine's supervisor -------------------------------------------------------------------

    async def _supervise(self) -> None:
        """Restart the engine whenever its loop has stopped, until close()."""
        backoff_s = RESTART_BACKOFF_S[0]
        while not await self._closed_within(ENGINE_CHECK_INTERVAL_S):
            engine = self.engine
            if engine is None or engine.is_running:
                continue
            if self._down_since is None:
                self._down_since = time.monotonic()
                logger.error("the engine stopped: restarting it (%d request(s) in flight "
                             "fail)", self.num_in_flight)
                await anyio.to_thread.run_sync(engine.shutdown)  # its process, pipes, threads
            try:
                served, restarted = await anyio.to_thread.run_sync(
                    self._model_loader, self.settings, self.tiers, int(time.time())
                )
            except Exception:
                self._num_failed_restarts += 1
                logger.exception("restarting the engine failed; next try in %.0f s", backoff_s)
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
            logger.warning("the engine was restarted after %.1f s", down_for_s)

    async def _closed_within(self, seconds: float) -> bool:
        """Wait up to seconds; True as soon as close() has begun."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(self._closing.wait(), seconds)
        return self._closing.is_set()

    # -- in-flight accounting (drain waits on it) --------------------------------------------------

    def request_started(self) -> None:
        self.num_in_flight += 1
        self._idle.clear()

    def request_ended(self) -> None:
        self.num_in_flight -= 1
        if self.num_in_flight == 0:
            self._idle.set()

    async def publish(self, record: RequestRecord) -> None:
        """Hand a finished request to the ledger, then to every other sink.

        Raises RecordLostError, once the other sinks have it (as a 503 failure), when the
        ledger could not make it durable: the caller then answers with an error instead of
        the result. Another sink's failure is logged.
        """
        lost: Exception | None = None
        if self.ledger is not None:
            try:
                await self.ledger.record(record)
            except Exception as exc:
                logger.error("the record of %s was not written: %s", record.request_id, exc)
                lost = exc
                record = dataclasses.replace(
                    record, status=RequestEnd.FAILED, http_status=RECORD_LOST_STATUS
                )
        for sink in self.sinks:
            try:
                await sink.record(record)
            except Exception:
                logger.exception("record sink %s failed for %s", type(sink).__name__,
                                 record.request_id)
        if lost is not None:
            raise RecordLostError(str(lost)) from lost
