"""One replica composed from its settings: runtime, ledger, admission, observability and
the app. `tiergate serve` runs it under uvicorn; tests run it with a fake model loader."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from sqlalchemy import Engine
from starlette.applications import Starlette

from billing import BillingError, Pricing, RefusalTally, UsageLedger
from gateway.access.admission import AdmissionSettings, GatewayAdmission, build_admission
from gateway.admin.auth import AdminGuard
from gateway.admin.billing_api import billing_routes
from gateway.admin.console_routes import console_routes
from gateway.batches.runner import BatchRunner
from gateway.observability.dependency_health import DependencyHealth
from gateway.observability.telemetry import Telemetry
from gateway.openai.routes import OpenAIApi
from gateway.server.app import build_app
from gateway.server.billing_wiring import LedgerBudgets, LedgerSink
from gateway.server.observability_wiring import Observability
from gateway.server.runtime import GatewayRuntime, ModelLoader
from gateway.server.served_model import load_served_model
from gateway.server.settings import GatewaySettings
from policies import TierTable


class ReplicaConfigError(ValueError):
    """A section of the config file is invalid; the message names it."""


@dataclass
class Replica:
    runtime: GatewayRuntime
    admission: GatewayAdmission
    ledger: UsageLedger
    observability: Observability
    app: Starlette


def compose_replica(
    settings: GatewaySettings,
    tiers: TierTable,
    db_engine: Engine,
    *,
    model_loader: ModelLoader = load_served_model,
    telemetry: Telemetry | None = None,
    on_fatal: Callable[[BaseException], None] | None = None,
) -> Replica:
    """Wire every part of a replica; nothing starts until the app's lifespan runs."""
    config = settings.file_config
    try:
        admission_settings = AdmissionSettings.from_config(config.get("admission"))
    except ValueError as exc:
        raise ReplicaConfigError(f"admission: {exc}") from None
    try:
        pricing = Pricing.from_mapping(config.get("pricing"))
        pricing.require_tiers([tier.name for tier in tiers])
    except BillingError as exc:
        raise ReplicaConfigError(f"pricing: {exc}") from None
    runtime = GatewayRuntime(settings, tiers, db_engine, model_loader=model_loader)
    settings.data_dir.mkdir(parents=True, exist_ok=True)
    ledger = UsageLedger(runtime.session_factory, settings.data_dir / "usage-spool.jsonl")
    refusals = RefusalTally(ledger.record)
    # A request's record is durable before its client sees the end.
    runtime.ledger = LedgerSink(ledger, pricing, refusals)
    runtime.on_start(ledger.start)
    runtime.on_start(refusals.start)
    admission = build_admission(
        admission_settings, tiers, settings.redis_url, runtime.engine_stats,
        usage=LedgerBudgets(ledger),
    )
    runtime.on_close(admission.aclose)
    try:
        observability = Observability.from_config(
            dict(config), tiers, runtime.engine_stats, runtime.engine_health,
            lambda: DependencyHealth(
                database_up=ledger.is_database_healthy,
                spool_bytes=ledger.spool_bytes,
                redis_up=admission.redis_up,
            ),
            runtime.weight_formats,
            telemetry,
        )
    except ValueError as exc:
        raise ReplicaConfigError(f"alerts: {exc}") from None
    runtime.telemetry = observability.telemetry
    runtime.sinks.append(observability)
    runtime.on_start(observability.start)
    runtime.on_close(observability.close)
    # The lines of the batches in the database, run as this replica's own requests would be.
    # One OpenAIApi serves the routes and the batch lines: one encoder thread for large
    # prompts, one response store.
    api = OpenAIApi(runtime, admission)
    runner = BatchRunner(runtime, api, runtime.file_storage,
                         max_in_flight=settings.batch_max_in_flight,
                         floor_in_flight=settings.batch_floor_in_flight,
                         lease_s=settings.batch_lease_s,
                         count_lines=observability.metrics.count_batch_lines)
    runtime.on_start(runner.start)
    runtime.on_close(runner.close)
    # Last: everything the drain let finish has been recorded by now.
    runtime.on_close(refusals.close)
    runtime.on_close(ledger.close)
    # One guard, so the admin routes share one cache of the admin credentials.
    admin_guard = AdminGuard.for_deployment(settings.admin_token, runtime.session_factory)
    app = build_app(
        runtime,
        api,
        extra_routes=[
            *observability.routes(admin_guard),
            *billing_routes(runtime.session_factory, admin_guard),
            *console_routes(),
        ],
        admin_guard=admin_guard,
        middleware=observability.middleware(),
        on_fatal=on_fatal,
    )
    return Replica(runtime, admission, ledger, observability, app)
