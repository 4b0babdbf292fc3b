"""Prometheus metrics: what each call records, tenant folding, the /metrics route, the
documentation table, and TTFT buckets fine enough for an honest p99."""

from __future__ import annotations

import math
import random
import re
from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.parser import text_string_to_metric_families
from starlette.applications import Starlette
from starlette.testclient import TestClient

from engine import SamplingParams, SchedulerStats, TenantContext
from gateway.observability.dependency_health import DependencyHealth
from gateway.observability.engine_health import EngineHealth
from gateway.observability.metrics import (
    OTHER_TENANT,
    TTFT_BUCKETS_S,
    GatewayMetrics,
    RequestObservation,
    RequestOutcome,
    TenantLabeler,
    metrics_route,
)
from gateway.observability.metrics_views import without_tenants
from policies import DEFAULT_TIERS
from policies.alerts import ALERT_NAME, AlertState, AlertStatus, TtftAlertRule
from tests.engine.helpers import make_engine, preempting_engine

METRICS_MD = Path(__file__).resolve().parents[3] / "ops" / "METRICS.md"
# Pool-wide series: the only ones without a tier label.
POOL_WIDE = {
    "tiergate_kv_blocks_total",
    "tiergate_kv_usage_ratio",
    "tiergate_prefix_cache_hit_ratio",
    "tiergate_engine_step_seconds",
    "tiergate_engine_busy_seconds",
    "tiergate_engine_steps",
    "tiergate_engine_preemptions",
    "tiergate_engine_tokens",
    "tiergate_gc_pause_seconds",  # the process's
    "tiergate_event_loop_lag_seconds",  # the process's
    "tiergate_engine_under_share_lane_steps",
    "tiergate_engine_up",
    "tiergate_engine_restarts",
    "tiergate_model_weight_format",
    "tiergate_ledger_database_up",
    "tiergate_ledger_spool_bytes",
    "tiergate_rate_limiter_redis_up",
}


COMPLETED = RequestObservation(
    tier="premium",
    tenant_id="7",
    status=RequestOutcome.COMPLETED,
    code=200,
    ttft_s=0.12,
    tpot_s=0.02,
    itl_s=(0.01, 0.02, 0.03),
    e2e_s=0.2,
    queue_s=0.05,
    num_prompt_tokens=100,
    num_cached_prompt_tokens=64,
    num_completion_tokens=4,
    gpu_seconds=0.5,
    model="m",
)


def _completed(**fields: Any) -> RequestObservation:
    return replace(COMPLETED, **fields)


def test_requests_on_adapters_are_counted_per_adapter() -> None:
    metrics = GatewayMetrics(DEFAULT_TIERS)
    metrics.observe_request(_completed(adapter="french"))
    metrics.observe_request(_completed(adapter="french"))
    metrics.observe_request(_completed())  # the base model: no adapter series
    value = metrics.registry.get_sample_value
    french = {"tier": "premium", "adapter": "french"}
    assert value("tiergate_adapter_tokens_total", french | {"kind": "completion"}) == (
        2 * COMPLETED.num_completion_tokens)
    assert value("tiergate_adapter_tokens_total", french | {"kind": "prompt"}) == (
        2 * COMPLETED.num_prompt_tokens)
    assert value("tiergate_adapter_gpu_seconds_total", french) == pytest.approx(
        2 * COMPLETED.gpu_seconds)
    assert value("tiergate_tokens_total", {"tier": "premium", "model": "m",
                                           "tenant": COMPLETED.tenant_id,
                                           "kind": "completion"}) == (
        3 * COMPLETED.num_completion_tokens)


def test_observe_request_records_every_series() -> None:
    metrics = GatewayMetrics(DEFAULT_TIERS)
    metrics.observe_request(
        _completed(recompute_gpu_seconds=0.25, recompute_charged_tenant_id="9", num_preemptions=2)
    )
    value = metrics.registry.get_sample_value
    premium = {"tier": "premium"}
    assert value("tiergate_requests_total",
                 premium | {"model": "m", "status": "completed", "code": "200"}) == 1
    assert value("tiergate_ttft_seconds_count", premium) == 1
    assert value("tiergate_ttft_seconds_sum", premium) == pytest.approx(0.12)
    assert value("tiergate_ttft_seconds_bucket", premium | {"le": "0.1"}) == 0
    assert value("tiergate_ttft_seconds_bucket", premium | {"le": "0.125"}) == 1
    assert value("tiergate_time_per_output_token_seconds_sum", premium) == pytest.approx(0.02)
    assert value("tiergate_inter_token_latency_seconds_count", premium) == 3
    assert value("tiergate_inter_token_latency_seconds_sum", premium) == pytest.approx(0.06)
    assert value("tiergate_e2e_latency_seconds_sum", premium) == pytest.approx(0.2)
    assert value("tiergate_queue_time_seconds_sum", premium) == pytest.approx(0.05)
    tenant = premium | {"model": "m", "tenant": "7"}
    assert value("tiergate_tokens_total", tenant | {"kind": "prompt"}) == 100
    assert value("tiergate_tokens_total", tenant | {"kind": "cached_prompt"}) == 64
    assert value("tiergate_tokens_total", tenant | {"kind": "completion"}) == 4
    assert value("tiergate_gpu_seconds_total", tenant) == pytest.approx(0.5)
    # Recompute is charged to the tenant whose request caused the preemption.
    assert value("tiergate_recompute_gpu_seconds_total", tenant) is None
    assert value("tiergate_recompute_gpu_seconds_total",
                 premium | {"model": "m", "tenant": "9"}) == 0.25
    assert value("tiergate_preemptions_total", premium) == 2
    # Other tiers exist from the start, at zero.
    assert value("tiergate_ttft_seconds_count", {"tier": "batch"}) == 0


def test_refused_request_counts_without_timings_or_tenant_series() -> None:
    metrics = GatewayMetrics(DEFAULT_TIERS)
    metrics.observe_request(
        RequestObservation("standard", "7", RequestOutcome.REFUSED, 429, e2e_s=0.003,
                           model="m")
    )
    metrics.record_rejection("standard", "tokens_per_minute")
    metrics.record_rejection("standard", "tokens_per_minute")
    metrics.record_rejection("batch", "slo_shed")
    value = metrics.registry.get_sample_value
    standard = {"tier": "standard"}
    assert value("tiergate_requests_total",
                 standard | {"model": "m", "status": "refused", "code": "429"}) == 1
    assert value("tiergate_ttft_seconds_count", standard) == 0
    assert value("tiergate_e2e_latency_seconds_count", standard) == 1
    assert value("tiergate_rejections_total", standard | {"reason": "tokens_per_minute"}) == 2
    assert value("tiergate_rejections_total", {"tier": "batch", "reason": "slo_shed"}) == 1
    assert metrics.tenants.label("8") == "8"  # "7" took no label slot


def test_tenant_labeler_caps_and_keeps_labels() -> None:
    labeler = TenantLabeler(num_labels=3, ranked_tenant_ids=["big", "bigger"])
    assert labeler.label("big") == "big" and labeler.label("bigger") == "bigger"
    assert labeler.label("first-new") == "first-new"  # the one free slot
    assert labeler.label("second-new") == OTHER_TENANT
    for _ in range(100):
        labeler.label("second-new")
    assert labeler.label("first-new") == "first-new"  # stable: never taken back
    assert labeler.label("second-new") == OTHER_TENANT
    assert TenantLabeler(0).label("x") == OTHER_TENANT
    with pytest.raises(ValueError):
        TenantLabeler(-1)


def test_tenant_series_stay_bounded() -> None:
    metrics = GatewayMetrics(DEFAULT_TIERS, tenant_labeler=TenantLabeler(num_labels=5))
    rng = random.Random(3)
    for _ in range(2000):
        tier = rng.choice(["premium", "standard", "batch"])
        metrics.observe_request(_completed(tenant_id=str(rng.randrange(500)), tier=tier))
    tenants = {
        sample.labels["tenant"]
        for family in metrics.registry.collect()
        for sample in family.samples
        if "tenant" in sample.labels
    }
    assert len(tenants) == 6 and OTHER_TENANT in tenants
    total = sum(
        metrics.registry.get_sample_value(
            "tiergate_tokens_total",
            {"tier": tier, "model": "m", "tenant": tenant, "kind": "completion"}
        )
        or 0
        for tier in ("premium", "standard", "batch")
        for tenant in tenants
    )
    assert total == 2000 * 4  # folding loses no tokens


def test_update_engine_mirrors_scheduler_stats() -> None:
    engine = make_engine(num_blocks=64, block_size=4, max_num_batched_tokens=16)
    premium = TenantContext(tenant_id="a", tier="premium", priority=0)
    standard = TenantContext(tenant_id="b", tier="standard", priority=1)
    params = SamplingParams(max_tokens=4, ignore_eos=True)
    engine.add_request("p", list(range(1, 13)), params, premium)
    for i in range(3):
        engine.add_request(f"s{i}", list(range(40, 52)), params, standard)
    engine.step()
    stats = engine.stats()
    stats.mean_step_time_s = 0.015  # the fake runner's steps take no wall time

    metrics = GatewayMetrics(DEFAULT_TIERS)
    metrics.update_engine("m", stats, {"premium": 0.0, "standard": 1.25, "batch": 4.0})
    metrics.update_engine("other", SchedulerStats(), {})  # a second model's idle engine
    value = metrics.registry.get_sample_value
    m = {"model": "m"}
    for tier_stats in stats.tiers.values():
        labels = m | {"tier": tier_stats.tier}
        assert value("tiergate_requests_running", labels) == tier_stats.num_running
        assert value("tiergate_requests_waiting", labels) == tier_stats.num_waiting
        assert value("tiergate_kv_blocks_used", labels) == tier_stats.num_kv_blocks
    assert value("tiergate_requests_running", m | {"tier": "premium"}) == 1
    assert value("tiergate_requests_running", {"model": "other", "tier": "premium"}) == 0
    assert (value("tiergate_requests_waiting", m | {"tier": "standard"}) or 0) >= 1
    assert value("tiergate_requests_running", m | {"tier": "batch"}) == 0
    assert value("tiergate_kv_blocks_total", m) == 64
    assert value("tiergate_kv_usage_ratio", m) == pytest.approx(stats.kv_usage)
    assert stats.kv_usage > 0
    assert value("tiergate_prefix_cache_hit_ratio", m) == stats.prefix_cache_hit_ratio
    assert value("tiergate_engine_step_seconds", m) == 0.015
    assert value("tiergate_admission_estimated_wait_seconds",
                 m | {"tier": "standard"}) == 1.25

    while engine.has_unfinished_requests():
        engine.step()
    metrics.update_engine("m", engine.stats(), {})
    assert value("tiergate_requests_running", m | {"tier": "premium"}) == 0
    assert value("tiergate_kv_blocks_used", m | {"tier": "standard"}) == 0


def test_the_weight_format_is_one_series_per_model() -> None:
    metrics = GatewayMetrics(DEFAULT_TIERS)
    value = metrics.registry.get_sample_value
    metrics.update_weight_format("m", "gguf-q4_1+q8_0")
    metrics.update_weight_format("m", "gguf-q4_1+q8_0")  # each scrape sets it again
    metrics.update_weight_format("other", "bfloat16")
    name = "tiergate_model_weight_format"
    assert value(name, {"model": "m", "weight_format": "gguf-q4_1+q8_0"}) == 1
    assert value(name, {"model": "other", "weight_format": "bfloat16"}) == 1
    metrics.update_weight_format("m", "float32")  # reloaded from another checkpoint
    assert value(name, {"model": "m", "weight_format": "gguf-q4_1+q8_0"}) is None
    assert value(name, {"model": "m", "weight_format": "float32"}) == 1


def test_engine_counters_are_mirrored_once() -> None:
    engine = preempting_engine()
    metrics = GatewayMetrics(DEFAULT_TIERS)
    value = metrics.registry.get_sample_value
    while engine.has_unfinished_requests():
        engine.step()
        metrics.update_engine("m", engine.stats(), {})
    counters = engine.stats().counters
    assert counters.num_preemptions >= 1 and counters.num_recomputed_tokens >= 1
    # A second scrape of the same totals adds nothing; another model's engine counts apart.
    metrics.update_engine("m", engine.stats(), {})
    metrics.update_engine("other", engine.stats(), {})
    m = {"model": "m"}
    assert value("tiergate_engine_steps_total", m) == counters.num_steps
    assert value("tiergate_engine_steps_total", {"model": "other"}) == counters.num_steps
    assert value("tiergate_engine_preemptions_total", m) == counters.num_preemptions
    for kind, total in (("prompt", counters.num_prompt_tokens),
                        ("recomputed", counters.num_recomputed_tokens),
                        ("generated", counters.num_generated_tokens)):
        assert value("tiergate_engine_tokens_total", m | {"kind": kind}) == total > 0
    assert value("tiergate_engine_under_share_lane_steps_total", m) == 0
    assert value("tiergate_engine_busy_seconds_total", m) == pytest.approx(counters.busy_time_s)


def test_alert_state_and_thresholds_are_exported() -> None:
    rule = TtftAlertRule("premium", 0.4)
    metrics = GatewayMetrics(DEFAULT_TIERS, alert_rules=[rule])
    value = metrics.registry.get_sample_value
    assert value("tiergate_ttft_slo_seconds", {"tier": "premium"}) == 0.5
    assert value("tiergate_ttft_slo_seconds", {"tier": "batch"}) is None
    assert value("tiergate_ttft_alert_threshold_seconds", {"tier": "premium"}) == 0.4
    assert math.isnan(value("tiergate_ttft_p99_window_seconds", {"tier": "premium"}) or 0)
    firing = AlertStatus(ALERT_NAME, "premium", AlertState.FIRING, 10.0, 0.7, 0.4, 50)
    metrics.update_alerts([firing])
    labels = {"alertname": ALERT_NAME, "tier": "premium"}
    assert value("tiergate_alert_firing", labels) == 1
    assert value("tiergate_ttft_p99_window_seconds", {"tier": "premium"}) == 0.7
    resolved = AlertStatus(ALERT_NAME, "premium", AlertState.RESOLVED, 20.0, 0.2, 0.4, 50)
    metrics.update_alerts([resolved])
    assert value("tiergate_alert_firing", labels) == 0


def populated_metrics() -> GatewayMetrics:
    """Every metric with at least one sample."""
    metrics = GatewayMetrics(DEFAULT_TIERS, alert_rules=[TtftAlertRule("premium", 0.4)])
    metrics.observe_request(
        _completed(recompute_gpu_seconds=0.1, num_preemptions=1, recompute_charged_tenant_id="3")
    )
    metrics.observe_request(_completed(adapter="french"))
    metrics.record_rejection("standard", "requests_per_minute")
    metrics.count_batch_lines("batch", "completed")
    stats = make_engine().stats()
    stats.mean_step_time_s = 0.01
    metrics.update_engine_health("m", EngineHealth(is_up=True, generation=1))
    metrics.update_engine("m", stats, {"premium": 0.0})
    metrics.update_weight_format("m", "gguf-q4_1")
    metrics.update_dependencies(DependencyHealth(database_up=True, spool_bytes=0, redis_up=True))
    metrics.update_alerts([AlertStatus(ALERT_NAME, "premium", AlertState.INACTIVE, None, None,
                                       0.4, 0)])  # fmt: skip
    return metrics


def _scrape(metrics: GatewayMetrics, accept: str = "") -> tuple[str, str]:
    return _scrape_registry(metrics.registry, accept)


def _families(text: str) -> list[Metric]:
    """The families of a scrape, less the _created series the text format shows as gauges."""
    families = list(text_string_to_metric_families(text))
    names = {family.name for family in families}
    return [f for f in families if not (f.name.endswith("_created") and f.name[:-8] in names)]


def test_metrics_route_serves_the_exposition_format() -> None:
    metrics = populated_metrics()
    content_type, text = _scrape(metrics)
    assert content_type.startswith("text/plain; version=0.0.4")
    families = _families(text)
    assert len(families) == 40
    for family in families:
        assert family.name.startswith("tiergate_"), family.name
        assert family.samples, family.name
        for sample in family.samples:
            if family.name not in POOL_WIDE:
                assert "tier" in sample.labels, sample
            if "tenant" in sample.labels:
                assert family.type == "counter", family.name
    content_type, text = _scrape(metrics, "application/openmetrics-text; version=1.0.0")
    assert content_type.startswith("application/openmetrics-text")
    assert text.endswith("# EOF\n")


def test_two_instances_do_not_share_a_registry() -> None:
    first, second = GatewayMetrics(DEFAULT_TIERS), GatewayMetrics(DEFAULT_TIERS)
    first.record_rejection("premium", "concurrency")
    labels = {"tier": "premium", "reason": "concurrency"}
    assert first.registry.get_sample_value("tiergate_rejections_total", labels) == 1
    assert second.registry.get_sample_value("tiergate_rejections_total", labels) is None


def _documented_metrics() -> dict[str, tuple[str, str]]:
    """name -> (type, labels) from the first table of ops/METRICS.md."""
    rows = re.findall(
        r"^\| `(tiergate_[a-z0-9_]+)` \| (\w+) \|([a-z_, ]*)\|", METRICS_MD.read_text(), re.M
    )
    return {name: (kind, labels.replace(" ", "")) for name, kind, labels in rows}


def test_metrics_md_documents_exactly_the_exported_metrics() -> None:
    _, text = _scrape(populated_metrics())
    exported: dict[str, tuple[str, list[str]]] = {}
    for family in _families(text):
        name = family.name + ("_total" if family.type == "counter" else "")
        labels = sorted({key for sample in family.samples for key in sample.labels} - {"le"})
        exported[name] = (family.type, labels)
    documented = _documented_metrics()
    assert set(documented) == set(exported)
    for name, (kind, labels) in exported.items():
        doc_kind, doc_labels = documented[name]
        assert doc_kind == kind, name
        assert sorted(filter(None, doc_labels.split(","))) == labels, name


def histogram_quantile(q: float, buckets: list[tuple[float, float]]) -> float:
    """Prometheus' histogram_quantile over cumulative (upper bound, count) buckets."""
    total = buckets[-1][1]
    rank = q * total
    lower, below = 0.0, 0.0
    for upper, count in buckets:
        if count >= rank:
            if math.isinf(upper):
                return lower  # Prometheus answers the highest finite bound
            return lower + (upper - lower) * (rank - below) / (count - below)
        lower, below = upper, count
    raise AssertionError("unreachable: the +Inf bucket holds every observation")


def _bucket_index(value: float) -> int:
    """Index of the bucket (upper bounds TTFT_BUCKETS_S, then +Inf) that holds value."""
    return next(
        (i for i, upper in enumerate(TTFT_BUCKETS_S) if value <= upper), len(TTFT_BUCKETS_S)
    )


LOADS: dict[str, Callable[[random.Random], float]] = {
    "premium lognormal": lambda rng: rng.lognormvariate(math.log(0.12), 0.45),
    "overloaded premium": lambda rng: rng.lognormvariate(math.log(0.3), 0.3),
    "bimodal, 3 % slow": lambda rng: rng.gauss(0.08, 0.01) if rng.random() > 0.03 else
    rng.uniform(0.35, 0.55),
    "standard uniform": lambda rng: rng.uniform(0.2, 2.5),
    "batch heavy tail": lambda rng: min(0.5 * rng.paretovariate(1.5), 50.0),
}  # fmt: skip


@pytest.mark.parametrize("load", LOADS)
def test_ttft_buckets_give_a_p99_within_one_bucket(load: str) -> None:
    rng = random.Random(11)
    samples = [max(0.001, LOADS[load](rng)) for _ in range(5000)]
    metrics = GatewayMetrics(DEFAULT_TIERS)
    for ttft_s in samples:
        metrics.observe_request(
            RequestObservation("premium", "1", RequestOutcome.COMPLETED, 200, ttft_s=ttft_s)
        )
    buckets = sorted(
        (float(sample.labels["le"]), sample.value)
        for family in metrics.registry.collect()
        if family.name == "tiergate_ttft_seconds"
        for sample in family.samples
        if sample.name.endswith("_bucket") and sample.labels["tier"] == "premium"
    )
    estimate = histogram_quantile(0.99, buckets)
    exact = sorted(samples)[math.ceil(0.99 * len(samples)) - 1]
    assert abs(_bucket_index(estimate) - _bucket_index(exact)) <= 1, (estimate, exact)
    if exact <= 1.0:  # the SLO range: within 50 ms
        assert abs(estimate - exact) <= 0.05, (estimate, exact)
    else:
        assert abs(estimate - exact) <= 0.25 * exact, (estimate, exact)


def test_slo_and_page_thresholds_are_bucket_edges() -> None:
    for tier in DEFAULT_TIERS:
        for value in (tier.ttft_slo_s, tier.alert_ttft_p99_s):
            assert value is None or value in TTFT_BUCKETS_S


def test_anonymous_scrapes_see_per_tenant_series_summed_over_tenants() -> None:
    metrics = GatewayMetrics(DEFAULT_TIERS)
    metrics.observe_request(_completed())  # tenant 7
    metrics.observe_request(_completed(tenant_id="8", gpu_seconds=0.25))
    metrics.observe_request(_completed(tier="standard", tenant_id="9"))
    full = metrics.registry.get_sample_value
    view = without_tenants(metrics.registry)
    _, text = _scrape_registry(view)
    assert "tenant=" not in text
    folded = view.get_sample_value
    premium = {"tier": "premium", "model": "m"}
    assert folded("tiergate_tokens_total", premium | {"kind": "prompt"}) == 200
    assert folded("tiergate_gpu_seconds_total", premium) == pytest.approx(0.75)
    assert folded("tiergate_gpu_seconds_total",
                  {"tier": "standard", "model": "m"}) == pytest.approx(0.5)
    created = [full("tiergate_gpu_seconds_created", premium | {"tenant": t}) for t in ("7", "8")]
    assert folded("tiergate_gpu_seconds_created", premium) == min(c for c in created if c)
    # Series without a tenant label are as they were.
    assert folded("tiergate_ttft_seconds_count", {"tier": "premium"}) == full(
        "tiergate_ttft_seconds_count", {"tier": "premium"}
    ) == 2


def _scrape_registry(registry: CollectorRegistry, accept: str = "") -> tuple[str, str]:
    app = Starlette(routes=[metrics_route(registry)])
    with TestClient(app) as client:
        response = client.get("/metrics", headers={"accept": accept} if accept else {})
    assert response.status_code == 200
    return response.headers["content-type"], response.text


def test_the_redis_gauge_is_absent_without_redis_and_follows_it_with() -> None:
    metrics = GatewayMetrics(DEFAULT_TIERS)
    metrics.update_dependencies(DependencyHealth(database_up=False, spool_bytes=512,
                                                 redis_up=None))
    value = metrics.registry.get_sample_value
    assert (value("tiergate_ledger_database_up"), value("tiergate_ledger_spool_bytes")) == (0, 512)
    assert value("tiergate_rate_limiter_redis_up") is None  # not 0: there is no Redis
    for is_up in (False, True):
        metrics.update_dependencies(DependencyHealth(True, 0, redis_up=is_up))
        assert value("tiergate_rate_limiter_redis_up") == int(is_up)
