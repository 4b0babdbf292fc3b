"""Built-in paging end to end on loopback: slow premium TTFTs page a real HTTP receiver once
(Alertmanager v2 and PagerDuty Events v2 bodies, validated against their documented shapes)
and resolve once; retries; the /admin/v1/alerts and /admin/v1/live routes."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator
from datetime import datetime
from typing import Any

import jsonschema
import pytest
from starlette.applications import Starlette
from starlette.testclient import TestClient

from engine import SamplingParams, TenantContext
from gateway.admin.auth import AdminGuard
from gateway.admin.live_api import alerts_routes, live_route
from gateway.http.errors import exception_handlers
from gateway.observability.alerting import (
    AlertingConfigError,
    AlertingSettings,
    AlertMonitor,
    AlertNotifier,
    WebhookFormat,
    WebhookTarget,
)
from gateway.observability.metrics import GatewayMetrics
from policies import DEFAULT_TIERS, estimate_queue_wait_s
from policies.alerts import ALERT_NAME, AlertEvaluator, AlertEvent, AlertEventKind, TtftAlertRule
from tests.engine.helpers import make_engine
from tests.gateway.conftest import ADMIN_TOKEN
from tests.gateway.loopback_receiver import LoopbackReceiver
from tests.manual_clock import ManualClock

ROUTING_KEY = "R0123456789abcdef0123456789abcde"  # 32 characters, as PagerDuty's
# Where the tests' clocks start: a wall-clock time, as the alerts' timestamps are.
START_S = 1_763_700_000.0


@pytest.fixture
def receiver() -> Iterator[LoopbackReceiver]:
    server = LoopbackReceiver()
    yield server
    server.close()


# Alertmanager's OpenAPI v2 (api/v2/openapi.yaml): postableAlerts, postableAlert, labelSet.
_LABEL_SET = {"type": "object", "additionalProperties": {"type": "string"}}
ALERTMANAGER_POSTABLE_ALERTS = {
    "type": "array",
    "items": {
        "type": "object",
        "required": ["labels"],
        "properties": {
            "labels": _LABEL_SET,
            "annotations": _LABEL_SET,
            "startsAt": {"type": "string"},
            "endsAt": {"type": "string"},
            "generatorURL": {"type": "string"},
        },
        "additionalProperties": False,
    },
}
# PagerDuty Events API v2, POST /v2/enqueue: the event body.
PAGERDUTY_EVENT = {
    "type": "object",
    "required": ["routing_key", "event_action", "dedup_key"],
    "properties": {
        "routing_key": {"type": "string", "minLength": 32, "maxLength": 32},
        "event_action": {"enum": ["trigger", "acknowledge", "resolve"]},
        "dedup_key": {"type": "string", "maxLength": 255},
        "client": {"type": "string"},
        "client_url": {"type": "string"},
        "payload": {
            "type": "object",
            "required": ["summary", "source", "severity"],
            "properties": {
                "summary": {"type": "string", "maxLength": 1024},
                "source": {"type": "string"},
                "severity": {"enum": ["critical", "error", "warning", "info"]},
                "timestamp": {"type": "string"},
                "component": {"type": "string"},
                "group": {"type": "string"},
                "class": {"type": "string"},
                "custom_details": {"type": "object"},
            },
            "additionalProperties": False,
        },
    },
    "additionalProperties": False,
    "if": {"properties": {"event_action": {"const": "trigger"}}},
    "then": {"required": ["payload"]},
}


def _unix_s(rfc3339: str) -> float:
    parsed = datetime.fromisoformat(rfc3339)
    assert parsed.tzinfo is not None, "timestamps carry their zone"
    return parsed.timestamp()


def _settings(receiver: LoopbackReceiver, **overrides: Any) -> AlertingSettings:
    values: dict[str, Any] = {
        "rules": (TtftAlertRule("premium", 0.4, window_s=60.0, for_s=10.0, min_samples=20),),
        "webhooks": (
            WebhookTarget(receiver.url("/am"), WebhookFormat.ALERTMANAGER),
            WebhookTarget(receiver.url("/pd"), WebhookFormat.PAGERDUTY, ROUTING_KEY),
        ),
        "replica": "gw-test",
        "generator_url": "http://gw-test:8000/admin",
        "evaluate_interval_s": 0.005,
        "initial_backoff_s": 0.01,
    } | overrides
    return AlertingSettings(**values)


async def _wait_for(condition: Any, timeout_s: float = 10.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not condition():
        assert time.monotonic() < deadline, "timed out"
        await asyncio.sleep(0.01)


def test_slow_premium_ttft_pages_once_and_resolves_once(receiver: LoopbackReceiver) -> None:
    clock = ManualClock(START_S)
    settings = _settings(receiver)
    metrics = GatewayMetrics(DEFAULT_TIERS, alert_rules=settings.rules)
    firing = {"alertname": ALERT_NAME, "tier": "premium"}
    fired_at: list[float] = []
    resolved_at: list[float] = []

    async def main() -> tuple[float, float]:
        monitor = AlertMonitor.from_settings(settings, metrics=metrics, clock=clock)
        await monitor.start()  # evaluates every 5 ms of real time as well

        async def traffic(premium_ttft_s: float, seconds: int) -> None:
            """10 premium and 10 standard requests per fake second, evaluated each second."""
            for _ in range(seconds):
                clock.now_s += 1.0
                for _ in range(10):
                    monitor.observe_ttft("premium", premium_ttft_s)
                    monitor.observe_ttft("standard", 1.0)
                for event in monitor.evaluate_now():
                    (fired_at if event.kind is AlertEventKind.FIRE else resolved_at).append(
                        clock.now_s
                    )
                await asyncio.sleep(0.001)

        await traffic(0.12, 30)
        slow_start_s = clock.now_s
        await traffic(0.9, 40)
        assert [s.state.value for s in monitor.statuses()] == ["firing"]
        assert metrics.registry.get_sample_value("tiergate_alert_firing", firing) == 1
        await _wait_for(lambda: len(receiver.received) == 2)
        recovery_start_s = clock.now_s
        await traffic(0.12, 120)
        await _wait_for(lambda: len(receiver.received) == 4)
        await asyncio.sleep(0.05)  # nothing else arrives
        await monitor.stop()
        return slow_start_s, recovery_start_s

    slow_start_s, recovery_start_s = asyncio.run(main())
    assert len(fired_at) == 1 and len(resolved_at) == 1
    # Fires within the window: the p99 breaches on the first slow second, then for_s.
    assert fired_at[0] == slow_start_s + 1 + 10
    assert recovery_start_s < resolved_at[0] <= recovery_start_s + 60
    assert metrics.registry.get_sample_value("tiergate_alert_firing", firing) == 0

    am_fire, am_resolve = (r.json() for r in receiver.posts("/am"))
    for body in (am_fire, am_resolve):
        jsonschema.validate(body, ALERTMANAGER_POSTABLE_ALERTS)
        (alert,) = body
        assert alert["labels"] == {
            "alertname": ALERT_NAME,
            "tier": "premium",
            "severity": "page",
            "service": "tiergate",
            "replica": "gw-test",
        }
        assert alert["generatorURL"] == "http://gw-test:8000/admin"
        assert _unix_s(alert["startsAt"]) == pytest.approx(fired_at[0])
        assert alert["annotations"]["dedup_key"] == "tiergate/gw-test/ttft_p99/premium"
    assert "endsAt" not in am_fire[0]  # firing until resolved
    assert _unix_s(am_resolve[0]["endsAt"]) == pytest.approx(resolved_at[0])
    assert "over 400 ms" in am_fire[0]["annotations"]["summary"]

    pd_trigger, pd_resolve = (r.json() for r in receiver.posts("/pd"))
    for body in (pd_trigger, pd_resolve):
        jsonschema.validate(body, PAGERDUTY_EVENT)
        assert body["routing_key"] == ROUTING_KEY
        assert body["dedup_key"] == "tiergate/gw-test/ttft_p99/premium"
    assert pd_trigger["event_action"] == "trigger"
    assert pd_resolve["event_action"] == "resolve"
    payload = pd_trigger["payload"]
    assert payload["severity"] == "critical" and payload["source"] == "gw-test"
    assert _unix_s(payload["timestamp"]) == pytest.approx(fired_at[0])
    assert payload["custom_details"]["ttft_p99_s"] == pytest.approx(0.9)
    assert all(r.headers["content-type"] == "application/json" for r in receiver.received)


def _event(kind: AlertEventKind = AlertEventKind.FIRE) -> AlertEvent:
    return AlertEvent(
        kind=kind,
        name=ALERT_NAME,
        tier="premium",
        dedup_key="tiergate/r/ttft_p99/premium",
        value_s=0.7,
        threshold_s=0.4,
        window_s=60.0,
        num_samples=100,
        started_at_s=1_763_700_000.0,
        ended_at_s=None if kind is AlertEventKind.FIRE else 1_763_700_100.0,
    )


def test_deliveries_retry_server_errors_and_give_up_on_refusals(
    receiver: LoopbackReceiver,
) -> None:
    receiver.fail_next = {"/am": [503, 502], "/pd": [400]}
    sleeps: list[float] = []

    async def record_sleep(seconds: float) -> None:
        sleeps.append(seconds)

    async def main() -> AlertNotifier:
        notifier = AlertNotifier(
            [
                WebhookTarget(receiver.url("/am"), WebhookFormat.ALERTMANAGER),
                WebhookTarget(receiver.url("/pd"), WebhookFormat.PAGERDUTY, ROUTING_KEY),
            ],
            replica="r",
            initial_backoff_s=0.5,
            sleep=record_sleep,
        )
        notifier.start()
        notifier.notify([_event(AlertEventKind.FIRE), _event(AlertEventKind.RESOLVE)])
        await notifier.aclose()
        return notifier

    notifier = asyncio.run(main())
    am = receiver.posts("/am")
    # Two failures, then the FIRE lands; the RESOLVE follows it, never before.
    assert [r.json()[0].get("endsAt") for r in am] == [None, None, None, am[-1].json()[0]["endsAt"]]
    assert am[-1].json()[0]["endsAt"] is not None
    assert sleeps == [0.5, 1.0]  # exponential backoff between the tries
    pd = receiver.posts("/pd")
    assert [r.json()["event_action"] for r in pd] == ["trigger", "resolve"]  # 400: no retry
    assert (notifier.num_delivered, notifier.num_failed) == (3, 1)


def test_unreachable_webhook_does_not_block_evaluation(receiver: LoopbackReceiver) -> None:
    receiver.delay_s = 2.0  # it records a post after this, then answers
    clock = ManualClock(START_S)
    settings = _settings(receiver, rules=(TtftAlertRule("premium", 0.4, for_s=0.0, min_samples=1),))

    async def main() -> None:
        monitor = AlertMonitor.from_settings(settings, clock=clock)
        await monitor.start()
        monitor.observe_ttft("premium", 2.0)
        (event,) = monitor.evaluate_now()
        assert receiver.received == []  # evaluation returned before any answer came
        assert event.kind is AlertEventKind.FIRE
        await monitor.stop()

    asyncio.run(main())
    assert len(receiver.received) == 2  # delivered on stop, after the slow receiver answered


def test_settings_from_config() -> None:
    settings = AlertingSettings.from_config(
        {
            "replica": "gw-7",
            "ttft_p99": {"premium": {"threshold_s": 0.3, "for_s": 30}},
            "webhooks": [
                {"url": "http://am:9093/api/v2/alerts"},
                {"url": "https://events.example/v2/enqueue", "format": "pagerduty",
                 "routing_key": ROUTING_KEY},
            ],
        },
        DEFAULT_TIERS,
    )  # fmt: skip
    assert settings.replica == "gw-7"
    assert settings.rules == (TtftAlertRule("premium", 0.3, for_s=30),)
    assert [w.format for w in settings.webhooks] == [
        WebhookFormat.ALERTMANAGER,
        WebhookFormat.PAGERDUTY,
    ]
    defaults = AlertingSettings.from_config(None, DEFAULT_TIERS)
    assert defaults.rules == (TtftAlertRule("premium", 0.4),) and defaults.webhooks == ()


@pytest.mark.parametrize(
    ("section", "message"),
    [
        ({"pager": []}, "unknown fields pager"),
        ({"webhooks": [{"url": "ftp://x"}]}, "must be http"),
        ({"webhooks": [{"url": "http://x", "format": "slack"}]}, "slack"),
        ({"webhooks": [{"url": "http://x", "format": "pagerduty"}]}, "routing_key"),
        ({"webhooks": [{"format": "alertmanager"}]}, "url"),
        ({"ttft_p99": {"gold": {"threshold_s": 1}}}, "unknown tiers: gold"),
        ({"evaluate_interval_s": 0}, "evaluate_interval_s"),
        ({"max_attempts": "3"}, "not supported between"),
    ],
)
def test_bad_config_raises(section: dict[str, Any], message: str) -> None:
    with pytest.raises(AlertingConfigError, match=message):
        AlertingSettings.from_config(section, DEFAULT_TIERS)


def test_alerts_and_live_routes() -> None:
    clock = ManualClock(START_S)
    rule = TtftAlertRule("premium", 0.4, for_s=0.0, min_samples=5)
    monitor = AlertMonitor(
        AlertEvaluator([rule], replica="r", clock=clock),
        AlertNotifier([], replica="r"),
    )
    engine = make_engine(num_blocks=64, block_size=4, max_num_batched_tokens=16)
    premium = TenantContext(tenant_id="acme", tier="premium", priority=0)
    standard = TenantContext(tenant_id="bob", tier="standard", priority=1)
    params = SamplingParams(max_tokens=8, ignore_eos=True)
    engine.add_request("p0", list(range(1, 13)), params, premium)
    for i in range(3):
        engine.add_request(f"s{i}", list(range(20, 32)), params, standard)
    engine.step()
    stats = engine.stats()
    for ttft_s in (0.1, 0.2, 0.3, 0.5, 0.9):
        monitor.observe_ttft("premium", ttft_s)
    monitor.evaluate_now()

    guard = AdminGuard(ADMIN_TOKEN)
    app = Starlette(
        routes=[
            *alerts_routes(guard, monitor),
            live_route(guard, engine_stats=lambda: {"m": stats}, tiers=DEFAULT_TIERS,
                       monitor=monitor, clock=clock),
        ],
        exception_handlers=exception_handlers(),
    )  # fmt: skip
    headers = {"x-admin-token": ADMIN_TOKEN}
    with TestClient(app) as client:
        assert client.get("/admin/v1/alerts").status_code == 401
        assert client.get("/admin/v1/live").status_code == 401
        alerts = client.get("/admin/v1/alerts", headers=headers).json()
        live = client.get("/admin/v1/live", headers=headers).json()

    alert = {
        "name": ALERT_NAME,
        "tier": "premium",
        "state": "firing",
        "since": clock.now_s,
        "value": 0.9,
        "threshold": 0.4,
    }
    assert alerts == {"alerts": [alert]}
    assert live["time"] == clock.now_s
    assert live["kv_blocks_total"] == stats.num_kv_blocks_total == 64
    assert live["kv_blocks_used"] == stats.num_kv_blocks_used > 0
    assert live["prefix_cache_hit_ratio"] == stats.prefix_cache_hit_ratio
    assert live["alerts"] == [alert]
    assert live["models"] == [{
        "model": "m", "num_running": sum(t.num_running for t in stats.tiers.values()),
        "num_waiting": sum(t.num_waiting for t in stats.tiers.values()),
        "kv_blocks_total": 64, "kv_blocks_used": stats.num_kv_blocks_used,
        "mean_step_time_s": stats.mean_step_time_s,
    }]
    tiers = {row["tier"]: row for row in live["tiers"]}
    assert [row["tier"] for row in live["tiers"]] == ["premium", "standard", "batch"]
    for row in live["tiers"]:
        assert set(row) == {
            "tier", "priority", "num_running", "num_waiting", "kv_blocks",
            "kv_blocks_reserved", "ttft_p99_s", "ttft_slo_s", "alert_threshold_s",
            "estimated_wait_s",
        }  # fmt: skip
    premium_stats, standard_stats = stats.tiers[0], stats.tiers[1]
    assert tiers["premium"]["num_running"] == premium_stats.num_running == 1
    assert tiers["premium"]["kv_blocks"] == premium_stats.num_kv_blocks > 0
    assert tiers["premium"]["ttft_p99_s"] == 0.9
    assert tiers["premium"]["ttft_slo_s"] == 0.5
    assert tiers["premium"]["alert_threshold_s"] == 0.4
    assert tiers["standard"]["num_running"] + tiers["standard"]["num_waiting"] == 3
    assert tiers["standard"]["num_waiting"] == standard_stats.num_waiting
    assert tiers["standard"]["alert_threshold_s"] is None
    assert tiers["standard"]["estimated_wait_s"] == estimate_queue_wait_s(stats, 1, 0)
    assert tiers["batch"]["num_running"] == tiers["batch"]["num_waiting"] == 0
    assert tiers["batch"]["ttft_p99_s"] is None and tiers["batch"]["ttft_slo_s"] is None
