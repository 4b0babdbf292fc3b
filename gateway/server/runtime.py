"""Everything one replica runs, built once at start and shared by the routes: settings,
database, key resolver, the served models (a `ModelHost` each: its engine in a process of its
own, and the supervisor that restarts it), admission, and the sinks that take each finished
request (ledger, metrics, alerting).

Lifecycle: ``start`` (from the app's lifespan) loads the models one after another, off the
event loop; the replica is ready once each has loaded or failed and at least one serves (a
model that fails to load leaves the others serving; with none loaded the replica stops).
``drain`` (SIGTERM) refuses new requests with 503, waits for those in flight up to a deadline,
then returns.
"""

from __future__ import annotations

import asyncio
import dataclasses
import logging
from collections.abc import Awaitable, Callable
from typing import Protocol

import anyio.to_thread
from sqlalchemy import Engine, text
from sqlalchemy.orm import Session, sessionmaker

import tenants
from engine import EngineClient, SchedulerStats
from gateway.access.auth import TenantKeyResolver, TenantPrincipal
from gateway.adapters import AdapterRegistry, AdapterStore
from gateway.files.storage import FileStorage, file_storage
from gateway.http.errors import ServiceUnavailableError
from gateway.observability.engine_health import EngineHealth
from gateway.observability.telemetry import Telemetry, TelemetrySettings, setup_telemetry
from gateway.openai.request_record import RequestEnd, RequestRecord
from gateway.server.model_host import ModelHost, ModelLoader
from gateway.server.model_spec import placed_specs
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
            max_pinned=settings.max_cpu_loras - settings.max_loras,
            serves_adapters=settings.max_loras > 0,
        )
        # Uploaded files' bytes (the Files API; batches read their input and write their
        # output there).
        self.file_storage: FileStorage = file_storage(settings.file_storage, settings.data_dir)
        # The served models by the name clients send, in the order they were given.
        self.models: dict[str, ModelHost] = {
            spec.served_name: ModelHost(settings, tiers, spec, model_loader)
            for spec in placed_specs(settings.models, settings.device)
        }
        # Takes each finished request first; when it fails, the client hears of it.
        self.ledger: RecordSink | None = None
        # Then these (metrics, alerting), in order: a failure is logged.
        self.sinks: list[RecordSink] = []
        self.is_draining = False
        self.num_in_flight = 0
        self._idle = asyncio.Event()
        self._idle.set()
        self._on_close: list[Callable[[], Awaitable[None]]] = []
        self._on_start: list[Callable[[], Awaitable[None]]] = []
        # Tracing of each request (no-op unless an OTLP endpoint is configured).
        self.telemetry: Telemetry = setup_telemetry(TelemetrySettings())
        # Called once every model has loaded or failed, with those loaded, before the
        # replica reports ready.
        self.on_loaded: Callable[[list[ServedModel]], None] | None = None

    # -- lifecycle -------------------------------------------------------------------------------

    async def start(self) -> None:
        """Start the background services, then load the models one after another (on CUDA
        each sizes its KV cache from what the earlier ones left); raises the first model's
        error when none loads."""
        for callback in self._on_start:
            await callback()
        errors: list[BaseException] = []
        for host in self.models.values():
            try:
                await host.load()
            except Exception as exc:
                errors.append(exc)
        loaded = [host.served for host in self.models.values() if host.served is not None]
        if not loaded:
            raise errors[0]
        if errors:
            logger.error("serving %d of %d models: %s failed to load", len(loaded),
                         len(self.models), ", ".join(h.name for h in self.models.values()
                                                     if h.load_error is not None))
        if self.on_loaded is not None:
            self.on_loaded(loaded)

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
        await asyncio.gather(*(host.close() for host in self.models.values()))
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

    def engine_health(self) -> dict[str, EngineHealth]:
        """Each model's engine: up, restarts, how long down."""
        return {name: host.health() for name, host in self.models.items()}

    def engine_stats(self, model: str) -> SchedulerStats:
        """A model's engine's latest statistics (empty before it is loaded)."""
        host = self.models.get(model)
        return host.stats() if host is not None else SchedulerStats()

    @property
    def is_model_loaded(self) -> bool:
        """Every model has loaded or failed, and one at least serves."""
        hosts = self.models.values()
        return all(h.is_settled for h in hosts) and any(h.is_up for h in hosts)

    def host(self, model: str | None = None) -> ModelHost:
        """The host of a served model by name; None: the first model given (the only one,
        in most replicas)."""
        return self.models[model] if model is not None else next(iter(self.models.values()))

    def database_answers(self) -> bool:
        """Whether the database answers a read of a table (SQLite's SELECT 1 would answer
        through a lock that stops every real query)."""
        try:
            with self.db_engine.connect() as connection:
                connection.execute(text("SELECT 1 FROM tenants LIMIT 1"))
            return True
        except Exception:
            return False

    def check_accepting(self) -> None:
        """503 while draining, or before any model has loaded: a new request is not taken."""
        if self.is_draining:
            raise ServiceUnavailableError(
                "this replica is shutting down; retry on another", code="draining"
            )
        if all(host.served is None for host in self.models.values()):
            failed = all(host.load_error is not None for host in self.models.values())
            raise ServiceUnavailableError(
                "the model failed to load" if failed else "the model is loading",
                code="model_not_ready",
            )

    def allowed_models(self, principal: TenantPrincipal) -> list[str]:
        """The served models (by name) the principal's tenant may use, loaded or not."""
        return [name for name in self.models if principal.may_use(name)]

    def loaded_models(self, principal: TenantPrincipal) -> dict[str, ServedModel]:
        """The served models the principal's tenant may use that have loaded (/v1/models)."""
        return {name: host.served for name, host in self.models.items()
                if host.served is not None and principal.may_use(name)}

    def weight_formats(self) -> dict[str, str]:
        """The loaded models' weight formats (ServedModel.weight_format) by name."""
        return {name: host.served.weight_format for name, host in self.models.items()
                if host.served is not None}

    @property
    def sole_model_name(self) -> str:
        """The served model's name where there is one; "" where there are several (what the
        record of a request refused before its body was read names)."""
        return next(iter(self.models)) if len(self.models) == 1 else ""

    def ready_model(self, model: str) -> tuple[ServedModel, EngineClient]:
        """A served model and its engine for a new request, or 503 (draining; the model
        loading, failed or restarting)."""
        self.check_accepting()
        return self.models[model].ready()

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
