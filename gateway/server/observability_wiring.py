"""Metrics, TTFT paging and tracing of one replica, fed by every finished request, and the
middleware that counts the API requests refused before admission."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from starlette.middleware import Middleware
from starlette.routing import BaseRoute
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from engine import SchedulerStats
from gateway.admin.auth import AdminGuard
from gateway.admin.live_api import alerts_routes, live_route
from gateway.observability.alerting import AlertingSettings, AlertMonitor
from gateway.observability.dependency_health import DependencyHealth
from gateway.observability.engine_health import EngineHealth
from gateway.observability.loop_lag import LoopLagWatch
from gateway.observability.metrics import (
    GatewayMetrics,
    RequestObservation,
    RequestOutcome,
    metrics_route,
)
from gateway.observability.metrics_views import without_tenants
from gateway.observability.telemetry import Telemetry, TelemetrySettings, setup_telemetry
from gateway.openai.request_record import RequestEnd, RequestRecord
from policies import TierTable, estimate_queue_wait_s

# The tier label of requests refused before admission: the caller may be unknown (401).
UNKNOWN_TIER = "unknown"
# Paths of the OpenAI API; only its requests are counted in tiergate_requests_total.
_API_PREFIX = "/v1/"
# Client errors counted from the request's record instead: admission refusals (429) and
# clients that left before the end (499).
_COUNTED_FROM_RECORDS = frozenset({429, 499})


class Observability:
    """The replica's metrics registry, alert monitor and tracer; a RecordSink."""

    def __init__(
        self,
        tiers: TierTable,
        alerting: AlertingSettings,
        engine_stats: Callable[[str], SchedulerStats],
        engine_health: Callable[[], Mapping[str, EngineHealth]],
        dependencies: Callable[[], DependencyHealth],
        weight_formats: Callable[[], Mapping[str, str]],
        telemetry: Telemetry | None = None,
    ) -> None:
        """engine_stats, engine_health, dependencies and weight_formats (the loaded models'
        ServedModel.weight_format by name) are read at each scrape."""
        self.tiers = tiers
        self.engine_stats = engine_stats
        self.engine_health = engine_health
        self.dependencies = dependencies
        self.weight_formats = weight_formats
        self.metrics = GatewayMetrics(tiers, alert_rules=alerting.rules)
        self.monitor = AlertMonitor.from_settings(alerting, metrics=self.metrics)
        self.telemetry = telemetry or setup_telemetry(TelemetrySettings.from_env())
        self.loop_watch = LoopLagWatch(self.metrics.observe_loop_lag)

    @classmethod
    def from_config(
        cls,
        file_config: dict[str, Any],
        tiers: TierTable,
        engine_stats: Callable[[str], SchedulerStats],
        engine_health: Callable[[], Mapping[str, EngineHealth]],
        dependencies: Callable[[], DependencyHealth],
        weight_formats: Callable[[], Mapping[str, str]],
        telemetry: Telemetry | None = None,
    ) -> Observability:
        """From the config file's sections (``alerts``); telemetry defaults to the
        environment's OTLP settings."""
        return cls(tiers, AlertingSettings.from_config(file_config.get("alerts"), tiers),
                   engine_stats, engine_health, dependencies, weight_formats, telemetry)

    async def start(self) -> None:
        await self.loop_watch.start()
        await self.monitor.start()

    async def close(self) -> None:
        await self.monitor.stop()
        await self.loop_watch.stop()
        self.telemetry.shutdown()

    def routes(self, guard: AdminGuard) -> list[BaseRoute]:
        # Anonymous: tenant labels summed away; an admin credential sees them.
        return [
            metrics_route(without_tenants(self.metrics.registry), refresh=self.refresh),
            metrics_route(self.metrics.registry, "/admin/v1/metrics", self.refresh,
                          guard.requiring("GET", "/admin/v1/metrics")),
            *alerts_routes(guard, self.monitor),
            live_route(guard, engine_stats=self._stats_by_model, tiers=self.tiers,
                       monitor=self.monitor),
        ]

    def middleware(self) -> list[Middleware]:
        """For build_app(middleware=...): counts the requests refused before admission."""
        return [Middleware(InvalidRequestCounter, metrics=self.metrics)]

    def _stats_by_model(self) -> dict[str, SchedulerStats]:
        return {model: self.engine_stats(model) for model in self.engine_health()}

    def refresh(self) -> None:
        """The gauges read from elsewhere (engines, ledger, Redis), before a scrape."""
        self.metrics.update_dependencies(self.dependencies())
        for model, weight_format in self.weight_formats().items():
            self.metrics.update_weight_format(model, weight_format)
        for model, health in self.engine_health().items():
            self.metrics.update_engine_health(model, health)
            stats = self.engine_stats(model)
            waits = {tier.name: estimate_queue_wait_s(stats, tier.priority, 0)
                     for tier in self.tiers}
            self.metrics.update_engine(model, stats, waits)

    async def record(self, record: RequestRecord) -> None:
        """RecordSink: one finished (or refused) request."""
        if record.status is RequestEnd.REFUSED:
            self.metrics.record_rejection(record.tier, record.refusal_reason or "unknown")
        self.metrics.observe_request(
            RequestObservation(
                tier=record.tier,
                tenant_id=str(record.tenant_id),
                model=record.model,
                status=RequestOutcome(record.status.value),
                code=record.http_status,
                ttft_s=record.ttft_s,
                tpot_s=record.tpot_s,
                itl_s=record.inter_token_gaps_s,
                e2e_s=record.e2e_time_s,
                queue_s=record.queue_time_s,
                num_prompt_tokens=record.num_prompt_tokens,
                num_cached_prompt_tokens=record.num_cached_prompt_tokens,
                num_completion_tokens=record.num_completion_tokens,
                gpu_seconds=record.gpu_seconds,
                recompute_gpu_seconds=record.recompute_gpu_seconds,
                recompute_charged_tenant_id=(
                    None if record.recompute_charged_tenant_id is None
                    else str(record.recompute_charged_tenant_id)
                ),
                num_preemptions=record.num_preemptions,
                adapter=record.adapter,
            )
        )
        if record.ttft_s is not None:
            self.monitor.observe_ttft(record.tier, record.ttft_s)


class InvalidRequestCounter:
    """ASGI middleware: an OpenAI API request answered with a client error before admission
    (400 bad body, 401/403 bad key, 404 unknown model or route, 413 body too large, ...) is
    counted in tiergate_requests_total as status "invalid" with its code. Admitted and
    admission-refused requests are counted from their RequestRecord instead."""

    def __init__(self, app: ASGIApp, metrics: GatewayMetrics) -> None:
        self.app = app
        self.metrics = metrics

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or not scope["path"].startswith(_API_PREFIX):
            await self.app(scope, receive, send)
            return

        async def send_counting(message: Message) -> None:
            if message["type"] == "http.response.start":
                code = int(message["status"])
                if 400 <= code < 500 and code not in _COUNTED_FROM_RECORDS:
                    self.metrics.observe_request(
                        RequestObservation(
                            tier=UNKNOWN_TIER,
                            tenant_id="",
                            status=RequestOutcome.INVALID,
                            code=code,
                        )
                    )
            await send(message)

        await self.app(scope, receive, send_counting)
