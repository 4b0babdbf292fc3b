"""Prometheus metrics of one gateway process, and the /metrics route serving them.

Every name starts with ``tiergate_`` and every per-request series carries the tier. The
tenant is a label only on the per-tenant counters (tokens, GPU-seconds), and only for the
tenants TenantLabeler picks; the rest are folded into ``other``; anonymous scrapes see them
summed over tenants (gateway/observability/metrics_views.py). ops/METRICS.md is the table
of every metric; tests keep the two in step.
"""

from __future__ import annotations

import enum
import math
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.exposition import choose_encoder
from starlette.requests import Request
from starlette.responses import Response
from starlette.routing import Route

from engine import SchedulerStats
from gateway.observability.dependency_health import DependencyHealth
from gateway.observability.engine_health import EngineHealth
from gateway.observability.gc_pauses import GcPauseCollector, GcPauses, process_gc_pauses
from gateway.observability.loop_lag import LAG_BUCKETS_S
from policies import AlertStatus, Tier, TtftAlertRule

OTHER_TENANT = "other"
_Endpoint = Callable[[Request], Awaitable[Response]]
DEFAULT_NUM_TENANT_LABELS = 20
DEFAULT_NUM_ADAPTER_LABELS = 100

# Bucket edges (seconds). TTFT: 25-50 ms steps up to 1 s, so the premium SLO (0.5 s) and its
# page threshold (0.4 s) are edges and a histogram p99 lands within one step of the exact
# one; coarser above, where only batch traffic lives.
TTFT_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.075, 0.1, 0.125, 0.15, 0.175, 0.2, 0.25, 0.3, 0.35, 0.4, 0.45,
    0.5, 0.6, 0.7, 0.8, 0.9, 1.0, 1.25, 1.5, 1.75, 2.0, 2.5, 3.0, 4.0, 5.0, 7.5, 10.0,
    15.0, 20.0, 30.0, 60.0,
)  # fmt: skip
# Per-token latencies: the TPOT objectives are 50 ms (premium) and 100 ms (standard).
TOKEN_LATENCY_BUCKETS_S = (
    0.001, 0.0025, 0.005, 0.0075, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.06,
    0.075, 0.1, 0.125, 0.15, 0.2, 0.3, 0.5, 0.75, 1.0, 2.5,
)  # fmt: skip
# Whole requests and queue waits: from milliseconds to several minutes of batch work.
DURATION_BUCKETS_S = (
    0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 0.75, 1.0, 1.5, 2.0, 3.0, 5.0, 7.5, 10.0, 15.0,
    20.0, 30.0, 45.0, 60.0, 120.0, 300.0, 600.0,
)  # fmt: skip


class RequestOutcome(enum.Enum):
    """How a request ended, the ``status`` label of tiergate_requests_total (the values of
    gateway.openai.request_record.RequestEnd, plus INVALID)."""

    COMPLETED = "completed"  # every choice ended by a stop condition or max_tokens
    ABORTED = "aborted"  # the client went away before the end
    FAILED = "failed"  # the engine (or the gateway) failed while running it
    REFUSED = "refused"  # admission said no (429/503): nothing ran
    INVALID = "invalid"  # rejected before admission: bad body, unknown model, bad key


# Outcomes of requests the engine never saw: their prompt tokens were never processed.
_NEVER_RAN = frozenset({RequestOutcome.REFUSED, RequestOutcome.INVALID})


@dataclass(frozen=True)
class RequestObservation:
    """What the gateway measured of one request, handed over once it has ended."""

    tier: str
    tenant_id: str  # the tenant's id as a string; folded by TenantLabeler
    status: RequestOutcome
    code: int  # HTTP status sent (499 when the client went away before the end)
    ttft_s: float | None = None  # arrival to first token; None when no token was produced
    tpot_s: float | None = None  # mean time per output token after the first
    itl_s: Sequence[float] = ()  # gaps between consecutive output tokens
    e2e_s: float | None = None  # arrival to the last byte
    queue_s: float | None = None  # time spent waiting in the engine before first scheduled
    num_prompt_tokens: int = 0
    num_cached_prompt_tokens: int = 0  # of num_prompt_tokens, served from the prefix cache
    num_completion_tokens: int = 0
    gpu_seconds: float = 0.0  # metered device time of its own compute
    recompute_gpu_seconds: float = 0.0  # device time recomputing its tokens after preemptions
    recompute_charged_tenant_id: str | None = None  # who pays the recompute (the preemptor)
    num_preemptions: int = 0
    adapter: str | None = None  # the LoRA adapter it ran on; None: the base model
    model: str = ""  # the served (base) model it asked for; "": refused before it was read


class TenantLabeler:
    """Caps the tenant label: at most num_labels tenants get their own value, others 'other'.

    Tenants named in ranked_tenant_ids (busiest first, e.g. by requests in the ledger) take
    the slots first; free slots then go to tenants as they first send traffic. A tenant
    keeps its label for the life of the process, so its series never move.
    """

    def __init__(
        self, num_labels: int = DEFAULT_NUM_TENANT_LABELS, ranked_tenant_ids: Iterable[str] = ()
    ) -> None:
        if num_labels < 0:
            raise ValueError(f"num_labels must be >= 0, got {num_labels}")
        self.num_labels = num_labels
        self._labelled: set[str] = set()
        for tenant_id in ranked_tenant_ids:
            if len(self._labelled) == num_labels:
                break
            self._labelled.add(tenant_id)

    def label(self, tenant_id: str) -> str:
        if tenant_id in self._labelled:
            return tenant_id
        if len(self._labelled) < self.num_labels and tenant_id != OTHER_TENANT:
            self._labelled.add(tenant_id)
            return tenant_id
        return OTHER_TENANT


class _Series:
    """The metric objects, registered on one registry."""

    def __init__(self, registry: CollectorRegistry) -> None:
        r = registry
        tier = ("tier",)
        tenant = ("tier", "model", "tenant")
        # An engine's series: one engine per served model.
        model = ("model",)
        tier_model = ("tier", "model")
        self.ttft = Histogram(
            "tiergate_ttft_seconds", "Time to first token.", tier,
            registry=r, buckets=TTFT_BUCKETS_S,
        )  # fmt: skip
        self.tpot = Histogram(
            "tiergate_time_per_output_token_seconds",
            "Mean time per output token after the first, per request.", tier,
            registry=r, buckets=TOKEN_LATENCY_BUCKETS_S,
        )  # fmt: skip
        self.itl = Histogram(
            "tiergate_inter_token_latency_seconds", "Gap between consecutive output tokens.",
            tier, registry=r, buckets=TOKEN_LATENCY_BUCKETS_S,
        )  # fmt: skip
        self.e2e = Histogram(
            "tiergate_e2e_latency_seconds", "Request arrival to its last byte.", tier,
            registry=r, buckets=DURATION_BUCKETS_S,
        )  # fmt: skip
        self.queue = Histogram(
            "tiergate_queue_time_seconds", "Time waiting in the engine before first scheduled.",
            tier, registry=r, buckets=DURATION_BUCKETS_S,
        )  # fmt: skip
        # Counters are named without _total: the client library appends it.
        self.requests = Counter(
            "tiergate_requests", "Requests by model, how they ended and HTTP status.",
            ("tier", "model", "status", "code"), registry=r,
        )  # fmt: skip
        self.tokens = Counter(
            "tiergate_tokens", "Tokens by kind (cached_prompt is a subset of prompt).",
            ("tier", "model", "tenant", "kind"), registry=r,
        )  # fmt: skip
        self.gpu_seconds = Counter(
            "tiergate_gpu_seconds", "Metered device seconds of own compute.", tenant,
            registry=r,
        )  # fmt: skip
        self.recompute_gpu_seconds = Counter(
            "tiergate_recompute_gpu_seconds", "Recompute after preemptions, by tenant charged.",
            tenant, registry=r,
        )  # fmt: skip
        # Per LoRA adapter (the first DEFAULT_NUM_ADAPTER_LABELS adapters seen; later ones
        # are "other"): what requests on it used.
        self.adapter_tokens = Counter(
            "tiergate_adapter_tokens", "Tokens of requests on LoRA adapters, by kind.",
            ("tier", "adapter", "kind"), registry=r,
        )  # fmt: skip
        self.adapter_gpu_seconds = Counter(
            "tiergate_adapter_gpu_seconds", "Metered device seconds of requests on adapters.",
            ("tier", "adapter"), registry=r,
        )  # fmt: skip
        self.preemptions = Counter(
            "tiergate_preemptions", "Preemptions suffered by finished requests.", tier,
            registry=r,
        )  # fmt: skip
        self.rejections = Counter(
            "tiergate_rejections", "Requests refused by admission (429s), by reason.",
            ("tier", "reason"), registry=r,
        )  # fmt: skip
        self.running = Gauge(
            "tiergate_requests_running", "Requests running.", tier_model, registry=r
        )
        self.waiting = Gauge(
            "tiergate_requests_waiting", "Requests waiting or preempted (autoscaling signal).",
            tier_model, registry=r,
        )  # fmt: skip
        self.kv_blocks_used = Gauge(
            "tiergate_kv_blocks_used", "KV blocks held by the tier's requests.", tier_model,
            registry=r,
        )  # fmt: skip
        self.kv_blocks_reserved = Gauge(
            "tiergate_kv_blocks_reserved", "KV blocks reserved for the tier.", tier_model,
            registry=r,
        )  # fmt: skip
        self.kv_blocks_total = Gauge(
            "tiergate_kv_blocks_total", "KV blocks in the pool.", model, registry=r
        )
        self.kv_usage = Gauge(
            "tiergate_kv_usage_ratio", "Share of KV blocks held by requests.", model, registry=r
        )
        self.prefix_hit_ratio = Gauge(
            "tiergate_prefix_cache_hit_ratio", "Prefix-cache block hits / lookups.", model,
            registry=r,
        )  # fmt: skip
        self.step_time = Gauge(
            "tiergate_engine_step_seconds",
            "Mean wall time per engine step over recent steps, the loop's work between steps "
            "included.",
            model, registry=r,
        )  # fmt: skip
        self.engine_busy = Counter(
            "tiergate_engine_busy_seconds",
            "Measured engine step time since start; every second is metered to some request.",
            model, registry=r,
        )  # fmt: skip
        self.engine_steps = Counter(
            "tiergate_engine_steps", "Engine steps that ran the model.", model, registry=r
        )
        self.engine_preemptions = Counter(
            "tiergate_engine_preemptions",
            "Preemptions as the engine makes them (tiergate_preemptions counts them by tier "
            "when the preempted request ends).",
            model, registry=r,
        )  # fmt: skip
        self.engine_tokens = Counter(
            "tiergate_engine_tokens",
            "Tokens the engine's steps computed: prompt (prefix-cache hits not included), "
            "recomputed (after preemptions), generated (sampled).",
            ("model", "kind"), registry=r,
        )  # fmt: skip
        # An info metric (1): per-model series join it on `model` for the weight format,
        # rather than each carrying it as a label.
        self.weight_format = Gauge(
            "tiergate_model_weight_format",
            "1 for the weight format the model's engine serves (float32, gguf-q4_1, ...).",
            ("model", "weight_format"), registry=r,
        )  # fmt: skip
        self.engine_up = Gauge(
            "tiergate_engine_up",
            "1 while the model's engine loop takes requests; 0 while it loads, is restarted "
            "or failed to load.",
            model, registry=r,
        )  # fmt: skip
        self.ledger_database_up = Gauge(
            "tiergate_ledger_database_up",
            "1 while the usage ledger commits to its database; 0 while it spools.", registry=r,
        )  # fmt: skip
        self.ledger_spool_bytes = Gauge(
            "tiergate_ledger_spool_bytes",
            "Usage records spooled while the database was away, not yet replayed (bytes).",
            registry=r,
        )  # fmt: skip
        self.engine_restarts = Counter(
            "tiergate_engine_restarts",
            "Restarts of an engine that had stopped, by outcome (restarted, failed).",
            ("model", "outcome"), registry=r,
        )  # fmt: skip
        self.engine_lane_steps = Counter(
            "tiergate_engine_under_share_lane_steps",
            "Steps that carried only the prompts of tenants under half their fair share.",
            model, registry=r,
        )  # fmt: skip
        self.loop_lag = Histogram(
            "tiergate_event_loop_lag_seconds",
            "How late the event loop ran a timer due every 10 ms: what any callback due "
            "then (a refusal, a token write) waited.",
            registry=r, buckets=LAG_BUCKETS_S,
        )  # fmt: skip
        self.estimated_wait = Gauge(
            "tiergate_admission_estimated_wait_seconds",
            "Admission's estimate of the queue wait of a new request.", tier_model, registry=r,
        )  # fmt: skip
        self.ttft_slo = Gauge(
            "tiergate_ttft_slo_seconds", "The tier's TTFT p99 objective.", tier, registry=r
        )
        self.alert_threshold = Gauge(
            "tiergate_ttft_alert_threshold_seconds", "The TTFT p99 that pages.", tier, registry=r
        )
        self.window_p99 = Gauge(
            "tiergate_ttft_p99_window_seconds",
            "TTFT p99 over the paging window (NaN: too few samples).", tier, registry=r,
        )  # fmt: skip
        self.alert_firing = Gauge(
            "tiergate_alert_firing", "1 while the in-process alert fires.",
            ("alertname", "tier"), registry=r,
        )  # fmt: skip
        self.batch_lines = Counter(
            "tiergate_batch_lines",
            "Batch lines this replica ended or gave back, by status: completed, failed (an "
            "error line), retried (given back until its retry-after), budget_stopped (ended by "
            "a budget), expired (ended by the completion window).",
            ("tier", "status"), registry=r,
        )  # fmt: skip


class GatewayMetrics:
    """The gateway's metrics on their own registry (never the global one)."""

    def __init__(
        self,
        tiers: Iterable[Tier],
        *,
        alert_rules: Sequence[TtftAlertRule] = (),
        tenant_labeler: TenantLabeler | None = None,
        gc_pauses: GcPauses | None = None,
    ) -> None:
        self.registry = CollectorRegistry()
        self.tenants = tenant_labeler or TenantLabeler()
        # Adapter labels are capped the same way (an admin registers adapters, but a deployment
        # may hold thousands).
        self.adapters = TenantLabeler(DEFAULT_NUM_ADAPTER_LABELS)
        self._series = _Series(self.registry)
        # the process's collector pauses (gateway/observability/gc_pauses.py), read at scrape time
        self.registry.register(GcPauseCollector(gc_pauses or process_gc_pauses()))
        self._tier_names: list[str] = []
        # Each engine's totals counted into the engine counters so far, by (model, counter),
        # and the engine they came from (a restarted engine counts from 0 again).
        self._engine_totals: dict[tuple[str, str], float] = {}
        self._engine_generation: dict[str, int] = {}
        self._restarts_counted: dict[tuple[str, str], int] = {}
        self._redis_up: Gauge | None = None
        self._weight_formats: dict[str, str] = {}  # the label set by model
        s = self._series
        for tier in tiers:
            self._tier_names.append(tier.name)
            # Touch every per-tier series so dashboards and rules see zeros, not gaps (the
            # engines' series appear with the first scrape, which reads every model's).
            for histogram in (s.ttft, s.tpot, s.itl, s.e2e, s.queue):
                histogram.labels(tier.name)
            s.preemptions.labels(tier.name)
            if tier.ttft_slo_s is not None:
                s.ttft_slo.labels(tier.name).set(tier.ttft_slo_s)
        for rule in alert_rules:
            s.alert_threshold.labels(rule.tier).set(rule.threshold_s)
            s.window_p99.labels(rule.tier).set(math.nan)

    def observe_loop_lag(self, late_s: float) -> None:
        """One heartbeat of the event loop woke late_s late (gateway/observability/loop_lag.py)."""
        self._series.loop_lag.observe(late_s)

    def observe_request(self, obs: RequestObservation) -> None:
        """Count one request that has ended (answered, refused, aborted or failed)."""
        s = self._series
        s.requests.labels(obs.tier, obs.model, obs.status.value, str(obs.code)).inc()
        for histogram, value in (
            (s.ttft, obs.ttft_s),
            (s.tpot, obs.tpot_s),
            (s.e2e, obs.e2e_s),
            (s.queue, obs.queue_s),
        ):
            if value is not None:
                histogram.labels(obs.tier).observe(value)
        itl = s.itl.labels(obs.tier)
        for gap_s in obs.itl_s:
            itl.observe(gap_s)
        if obs.num_preemptions:
            s.preemptions.labels(obs.tier).inc(obs.num_preemptions)
        if obs.status in _NEVER_RAN or not (
            obs.num_prompt_tokens or obs.num_completion_tokens or obs.gpu_seconds
        ):
            return  # never reached the engine: no tokens, no per-tenant series for it
        tenant = self.tenants.label(obs.tenant_id)
        for kind, num_tokens in (
            ("prompt", obs.num_prompt_tokens),
            ("cached_prompt", obs.num_cached_prompt_tokens),
            ("completion", obs.num_completion_tokens),
        ):
            s.tokens.labels(obs.tier, obs.model, tenant, kind).inc(num_tokens)
        s.gpu_seconds.labels(obs.tier, obs.model, tenant).inc(obs.gpu_seconds)
        if obs.adapter is not None:
            adapter = self.adapters.label(obs.adapter)
            s.adapter_tokens.labels(obs.tier, adapter, "prompt").inc(obs.num_prompt_tokens)
            s.adapter_tokens.labels(obs.tier, adapter, "completion").inc(
                obs.num_completion_tokens)
            s.adapter_gpu_seconds.labels(obs.tier, adapter).inc(obs.gpu_seconds)
        if obs.recompute_gpu_seconds:
            charged = obs.recompute_charged_tenant_id or obs.tenant_id
            s.recompute_gpu_seconds.labels(obs.tier, obs.model, self.tenants.label(charged)).inc(
                obs.recompute_gpu_seconds
            )

    def count_batch_lines(self, tier: str, status: str, num_lines: int = 1) -> None:
        """Batch lines of a tier (the one batches run in) that ended, or were given back,
        with this status."""
        self._series.batch_lines.labels(tier, status).inc(num_lines)

    def record_rejection(self, tier: str, reason: str) -> None:
        """One request refused by admission; reason is a fixed word (e.g. 'tokens_per_minute')."""
        self._series.rejections.labels(tier, reason).inc()

    def update_engine(
        self, model: str, stats: SchedulerStats, estimated_wait_by_tier: Mapping[str, float]
    ) -> None:
        """Set a model's engine gauges from its scheduler snapshot; tiers absent from it
        read 0."""
        s = self._series
        by_name = {tier_stats.tier: tier_stats for tier_stats in stats.tiers.values()}
        for name in dict.fromkeys([*self._tier_names, *by_name]):
            tier_stats = by_name.get(name)
            s.running.labels(name, model).set(tier_stats.num_running if tier_stats else 0)
            s.waiting.labels(name, model).set(tier_stats.num_waiting if tier_stats else 0)
            s.kv_blocks_used.labels(name, model).set(
                tier_stats.num_kv_blocks if tier_stats else 0)
            s.kv_blocks_reserved.labels(name, model).set(
                tier_stats.num_kv_blocks_reserved if tier_stats else 0
            )
        for name, wait_s in estimated_wait_by_tier.items():
            s.estimated_wait.labels(name, model).set(wait_s)
        s.kv_blocks_total.labels(model).set(stats.num_kv_blocks_total)
        s.kv_usage.labels(model).set(stats.kv_usage)
        s.prefix_hit_ratio.labels(model).set(stats.prefix_cache_hit_ratio)
        if stats.mean_step_time_s is not None:
            s.step_time.labels(model).set(stats.mean_step_time_s)
        counters = stats.counters
        for name, counter, total in (
            ("busy", s.engine_busy.labels(model), counters.busy_time_s),
            ("steps", s.engine_steps.labels(model), counters.num_steps),
            ("preemptions", s.engine_preemptions.labels(model), counters.num_preemptions),
            ("prompt", s.engine_tokens.labels(model, "prompt"), counters.num_prompt_tokens),
            ("recomputed", s.engine_tokens.labels(model, "recomputed"),
             counters.num_recomputed_tokens),
            ("generated", s.engine_tokens.labels(model, "generated"),
             counters.num_generated_tokens),
            ("lane_steps", s.engine_lane_steps.labels(model), counters.num_lane_steps),
        ):
            self._advance((model, name), counter, total)

    def update_dependencies(self, health: DependencyHealth) -> None:
        s = self._series
        s.ledger_database_up.set(1 if health.database_up else 0)
        s.ledger_spool_bytes.set(health.spool_bytes)
        if health.redis_up is None:
            return
        if self._redis_up is None:  # absent, rather than 0, where no Redis is configured
            self._redis_up = Gauge(
                "tiergate_rate_limiter_redis_up",
                "1 while the shared rate limiter reaches Redis; 0 while it falls back "
                "(fail_open) or refuses (fail_closed). Absent without Redis.",
                registry=self.registry,
            )  # fmt: skip
        self._redis_up.set(1 if health.redis_up else 0)

    def update_weight_format(self, model: str, weight_format: str) -> None:
        """The format a model's engine serves its weights in: one series per model, moved to
        the new label when a reloaded engine serves another."""
        gauge, previous = self._series.weight_format, self._weight_formats.get(model)
        if previous == weight_format:
            return
        if previous is not None:
            gauge.remove(model, previous)
        gauge.labels(model, weight_format).set(1)
        self._weight_formats[model] = weight_format

    def update_engine_health(self, model: str, health: EngineHealth) -> None:
        """A model's engine: up or not, and the restarts so far; call before update_engine
        (a new engine's statistics count from 0 again)."""
        s = self._series
        s.engine_up.labels(model).set(1 if health.is_up else 0)
        for outcome, total in (
            ("restarted", health.num_restarts), ("failed", health.num_failed_restarts)
        ):
            restarts = s.engine_restarts.labels(model, outcome)  # zeros, not gaps
            counted = self._restarts_counted.get((model, outcome), 0)
            if total > counted:
                restarts.inc(total - counted)
                self._restarts_counted[(model, outcome)] = total
        if health.generation != self._engine_generation.get(model, 0):
            self._engine_generation[model] = health.generation
            for key in [key for key in self._engine_totals if key[0] == model]:
                del self._engine_totals[key]

    def _advance(self, key: tuple[str, str], counter: Any, total: float) -> None:
        """An engine's totals only grow; a counter takes the increment since the last call."""
        counted = self._engine_totals.get(key, 0.0)
        if total > counted:
            counter.inc(total - counted)
            self._engine_totals[key] = total

    def update_alerts(self, statuses: Iterable[AlertStatus]) -> None:
        """Mirror the in-process alerts: firing flag and windowed p99 per tier."""
        s = self._series
        for status in statuses:
            s.alert_firing.labels(status.name, status.tier).set(status.state.is_firing)
            s.window_p99.labels(status.tier).set(
                math.nan if status.value_s is None else status.value_s
            )


def metrics_route(
    registry: CollectorRegistry,
    path: str = "/metrics",
    refresh: Callable[[], None] | None = None,
    guard: Callable[[_Endpoint], _Endpoint] | None = None,
) -> Route:
    """GET path: the registry in the Prometheus text format (OpenMetrics when asked for).
    refresh, when given, updates the gauges read from elsewhere (the engine) first; guard
    wraps the endpoint (the admin credential)."""

    async def endpoint(request: Request) -> Response:
        if refresh is not None:
            refresh()
        encode, content_type = choose_encoder(request.headers.get("accept", ""))
        return Response(encode(registry), media_type=content_type)

    return Route(path, endpoint if guard is None else guard(endpoint), methods=["GET"])
