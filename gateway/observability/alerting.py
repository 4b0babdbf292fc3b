"""Built-in paging: TTFT p99 alerts evaluated in-process and posted to webhooks.

AlertMonitor feeds request TTFTs to policies.alerts.AlertEvaluator, evaluates it about once
a second on the event loop and hands each FIRE and RESOLVE to AlertNotifier, which posts it,
once, to every configured webhook: Alertmanager's v2 API (a JSON list of alerts) or
PagerDuty's Events API v2. Deliveries run in background tasks with retries and backoff;
request handling never waits on them.

A firing alert is posted without ``endsAt``: Alertmanager then keeps it for its
``resolve_timeout``, so set that above the longest expected incident, or page through the
Prometheus rules in ops/prometheus, which Prometheus re-sends while they fire.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import logging
import socket
import threading
import time
from collections.abc import Awaitable, Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any

import httpx

from gateway.observability.metrics import GatewayMetrics
from policies import (
    AlertEvaluator,
    AlertEvent,
    AlertEventKind,
    AlertRuleError,
    AlertStatus,
    Tier,
    TtftAlertRule,
    rules_from_tiers,
)

logger = logging.getLogger(__name__)

_CONFIG_FIELDS = (
    "replica",
    "generator_url",
    "evaluate_interval_s",
    "ttft_p99",
    "webhooks",
    "max_attempts",
)
_RETRYABLE_STATUSES = frozenset({408, 425, 429})


class AlertingConfigError(ValueError):
    """The alerts section of the configuration does not validate."""


class WebhookFormat(enum.Enum):
    ALERTMANAGER = "alertmanager"  # POST /api/v2/alerts of an Alertmanager
    PAGERDUTY = "pagerduty"  # PagerDuty Events API v2 (https://events.pagerduty.com/v2/enqueue)


@dataclass(frozen=True)
class WebhookTarget:
    """One place alerts are posted to."""

    url: str
    format: WebhookFormat
    routing_key: str | None = None  # PagerDuty integration key; required for PAGERDUTY

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise AlertingConfigError(f"webhook url must be http(s): {self.url!r}")
        if self.format is WebhookFormat.PAGERDUTY and not self.routing_key:
            raise AlertingConfigError(f"pagerduty webhook {self.url} needs a routing_key")


@dataclass(frozen=True)
class AlertingSettings:
    """Rules, receivers and delivery policy of the built-in paging."""

    rules: tuple[TtftAlertRule, ...]
    webhooks: tuple[WebhookTarget, ...] = ()
    replica: str = field(default_factory=socket.gethostname)  # in dedup keys and labels
    generator_url: str | None = None  # link sent with alerts (e.g. the console)
    evaluate_interval_s: float = 1.0
    max_attempts: int = 6  # per delivery, the first try included
    initial_backoff_s: float = 0.5  # doubled after each failed try
    max_backoff_s: float = 30.0
    timeout_s: float = 5.0  # per HTTP try

    def __post_init__(self) -> None:
        if not self.evaluate_interval_s > 0:
            raise AlertingConfigError("alerts.evaluate_interval_s must be > 0")
        if self.max_attempts < 1:
            raise AlertingConfigError("alerts.max_attempts must be >= 1")

    @classmethod
    def from_config(
        cls, section: Mapping[str, Any] | None, tiers: Iterable[Tier]
    ) -> AlertingSettings:
        """From the config file's ``alerts`` section (None: the tier table's defaults)::

        alerts:
          replica: gw-1
          ttft_p99: {premium: {threshold_s: 0.4, window_s: 300, for_s: 60, min_samples: 20}}
          webhooks:
            - {url: "http://alertmanager:9093/api/v2/alerts", format: alertmanager}
            - {url: "https://events.pagerduty.com/v2/enqueue", format: pagerduty,
               routing_key: "..."}
        """
        section = dict(section or {})
        unknown = set(section) - set(_CONFIG_FIELDS)
        if unknown:
            raise AlertingConfigError(f"alerts: unknown fields {', '.join(sorted(unknown))}")
        try:
            rules = tuple(rules_from_tiers(tiers, section.pop("ttft_p99", None)))
            webhooks = tuple(
                WebhookTarget(
                    url=entry["url"],
                    format=WebhookFormat(entry.get("format", "alertmanager")),
                    routing_key=entry.get("routing_key"),
                )
                for entry in section.pop("webhooks", None) or ()
            )
        except AlertRuleError as exc:
            raise AlertingConfigError(f"alerts: {exc}") from exc
        except (KeyError, TypeError, ValueError) as exc:
            raise AlertingConfigError(f"alerts.webhooks: {exc}") from exc
        try:
            return cls(rules=rules, webhooks=webhooks, **section)
        except TypeError as exc:  # e.g. a string where a number belongs
            raise AlertingConfigError(f"alerts: {exc}") from exc


def _rfc3339(unix_s: float) -> str:
    return datetime.fromtimestamp(unix_s, UTC).isoformat(timespec="milliseconds")


def _summary(event: AlertEvent) -> str:
    value = "n/a" if event.value_s is None else f"{event.value_s * 1000:.0f} ms"
    verb = "over" if event.kind is AlertEventKind.FIRE else "back under"
    return (
        f"tiergate {event.tier} TTFT p99 {value} {verb} {event.threshold_s * 1000:.0f} ms "
        f"({event.window_s:.0f} s window, {event.num_samples} requests)"
    )


def alertmanager_alerts(
    event: AlertEvent, *, replica: str, generator_url: str | None
) -> list[dict[str, Any]]:
    """The body of POST /api/v2/alerts: a list of postable alerts (labels identify one)."""
    alert: dict[str, Any] = {
        "labels": {
            "alertname": event.name,
            "tier": event.tier,
            "severity": "page",
            "service": "tiergate",
            "replica": replica,
        },
        "annotations": {
            "summary": _summary(event),
            "dedup_key": event.dedup_key,
            "value_s": "" if event.value_s is None else f"{event.value_s:.4f}",
            "threshold_s": f"{event.threshold_s:.4f}",
        },
        "startsAt": _rfc3339(event.started_at_s),
    }
    if event.ended_at_s is not None:
        alert["endsAt"] = _rfc3339(event.ended_at_s)
    if generator_url:
        alert["generatorURL"] = generator_url
    return [alert]


def pagerduty_event(
    event: AlertEvent, *, routing_key: str, replica: str, generator_url: str | None
) -> dict[str, Any]:
    """A PagerDuty Events API v2 event: trigger on FIRE, resolve on RESOLVE (same dedup_key)."""
    body: dict[str, Any] = {
        "routing_key": routing_key,
        "dedup_key": event.dedup_key,
        "client": "tiergate",
    }
    if generator_url:
        body["client_url"] = generator_url
    if event.kind is AlertEventKind.RESOLVE:
        return {**body, "event_action": "resolve"}
    return {
        **body,
        "event_action": "trigger",
        "payload": {
            "summary": _summary(event)[:1024],
            "source": replica,
            "severity": "critical",
            "timestamp": _rfc3339(event.started_at_s),
            "component": "gateway",
            "group": event.tier,
            "class": "ttft_p99",
            "custom_details": {
                "alertname": event.name,
                "tier": event.tier,
                "ttft_p99_s": event.value_s,
                "threshold_s": event.threshold_s,
                "window_s": event.window_s,
                "num_samples": event.num_samples,
            },
        },
    }


@dataclass
class _Delivery:
    target: WebhookTarget
    body: Any  # JSON body
    event: AlertEvent


class AlertNotifier:
    """Posts alert events to webhooks from background tasks, in order per webhook."""

    def __init__(
        self,
        targets: Sequence[WebhookTarget],
        *,
        replica: str,
        generator_url: str | None = None,
        client: httpx.AsyncClient | None = None,
        max_attempts: int = 6,
        initial_backoff_s: float = 0.5,
        max_backoff_s: float = 30.0,
        timeout_s: float = 5.0,
        sleep: Callable[[float], Awaitable[None]] = asyncio.sleep,
    ) -> None:
        self.targets = tuple(targets)
        self._replica = replica
        self._generator_url = generator_url
        self._client = client or httpx.AsyncClient(timeout=timeout_s)
        self._owns_client = client is None
        self._max_attempts = max_attempts
        self._initial_backoff_s = initial_backoff_s
        self._max_backoff_s = max_backoff_s
        self._sleep = sleep
        self._queues = [asyncio.Queue[_Delivery]() for _ in self.targets]
        self._workers: list[asyncio.Task[None]] = []
        self.num_delivered = 0  # posts a webhook accepted
        self.num_failed = 0  # posts given up after the last try

    def start(self) -> None:
        """Start one delivery task per webhook on the running loop."""
        if not self._workers:
            self._workers = [
                asyncio.create_task(self._work(queue), name=f"tiergate-alert-webhook-{i}")
                for i, queue in enumerate(self._queues)
            ]

    def notify(self, events: Iterable[AlertEvent]) -> None:
        """Queue the events for every webhook; returns at once."""
        for event in events:
            for target, queue in zip(self.targets, self._queues, strict=True):
                queue.put_nowait(_Delivery(target, self._body(target, event), event))

    async def aclose(self, timeout_s: float = 5.0) -> None:
        """Deliver what is queued (for at most timeout_s), then stop."""
        with contextlib.suppress(TimeoutError):
            await asyncio.wait_for(
                asyncio.gather(*(queue.join() for queue in self._queues)), timeout_s
            )
        for worker in self._workers:
            worker.cancel()
        await asyncio.gather(*self._workers, return_exceptions=True)
        self._workers = []
        if self._owns_client:
            await self._client.aclose()

    def _body(self, target: WebhookTarget, event: AlertEvent) -> Any:
        if target.format is WebhookFormat.ALERTMANAGER:
            return alertmanager_alerts(
                event, replica=self._replica, generator_url=self._generator_url
            )
        assert target.routing_key is not None  # WebhookTarget validates it
        return pagerduty_event(
            event,
            routing_key=target.routing_key,
            replica=self._replica,
            generator_url=self._generator_url,
        )

    async def _work(self, queue: asyncio.Queue[_Delivery]) -> None:
        while True:
            delivery = await queue.get()
            try:
                await self._deliver(delivery)
            finally:
                queue.task_done()

    async def _deliver(self, delivery: _Delivery) -> None:
        url = delivery.target.url
        backoff_s = self._initial_backoff_s
        for attempt in range(1, self._max_attempts + 1):
            try:
                response = await self._client.post(url, json=delivery.body)
            except httpx.HTTPError as exc:
                problem = f"{type(exc).__name__}: {exc}"
            else:
                if response.is_success:
                    self.num_delivered += 1
                    return
                problem = f"HTTP {response.status_code}"
                if response.status_code < 500 and response.status_code not in _RETRYABLE_STATUSES:
                    break  # the receiver refuses this body: retrying will not help
            if attempt < self._max_attempts:
                logger.warning("alert to %s failed (%s); retry in %.1f s", url, problem, backoff_s)
                await self._sleep(backoff_s)
                backoff_s = min(backoff_s * 2, self._max_backoff_s)
        self.num_failed += 1
        logger.error(
            "alert %s %s for %s not delivered to %s: %s",
            delivery.event.name,
            delivery.event.kind.value,
            delivery.event.tier,
            url,
            problem,
        )


class AlertMonitor:
    """Evaluates the TTFT alerts about once a second and sends their transitions."""

    def __init__(
        self,
        evaluator: AlertEvaluator,
        notifier: AlertNotifier,
        *,
        interval_s: float = 1.0,
        metrics: GatewayMetrics | None = None,
    ) -> None:
        self._evaluator = evaluator
        self._notifier = notifier
        self._interval_s = interval_s
        self._metrics = metrics
        self._lock = threading.Lock()  # observe_ttft may come from any thread
        self._task: asyncio.Task[None] | None = None

    @classmethod
    def from_settings(
        cls,
        settings: AlertingSettings,
        *,
        metrics: GatewayMetrics | None = None,
        clock: Callable[[], float] = time.time,
        client: httpx.AsyncClient | None = None,
    ) -> AlertMonitor:
        notifier = AlertNotifier(
            settings.webhooks,
            replica=settings.replica,
            generator_url=settings.generator_url,
            client=client,
            max_attempts=settings.max_attempts,
            initial_backoff_s=settings.initial_backoff_s,
            max_backoff_s=settings.max_backoff_s,
            timeout_s=settings.timeout_s,
        )
        evaluator = AlertEvaluator(settings.rules, replica=settings.replica, clock=clock)
        return cls(evaluator, notifier, interval_s=settings.evaluate_interval_s, metrics=metrics)

    def observe_ttft(self, tier: str, ttft_s: float) -> None:
        """One request's time to first token (cheap; never blocks on I/O)."""
        with self._lock:
            self._evaluator.observe(tier, ttft_s)

    def evaluate_now(self) -> list[AlertEvent]:
        """One evaluation: transitions are queued for delivery and mirrored in the metrics."""
        with self._lock:
            events = self._evaluator.evaluate()
            statuses = self._evaluator.statuses()
        for event in events:
            logger.warning("alert %s %s: %s", event.name, event.kind.value, _summary(event))
        self._notifier.notify(events)
        if self._metrics is not None:
            self._metrics.update_alerts(statuses)
        return events

    def statuses(self) -> list[AlertStatus]:
        with self._lock:
            return self._evaluator.statuses()

    def rule(self, tier: str) -> TtftAlertRule | None:
        return next((rule for rule in self._evaluator.rules if rule.tier == tier), None)

    def p99_s(self, tier: str) -> float | None:
        with self._lock:
            return self._evaluator.p99_s(tier)

    async def start(self) -> None:
        """Start the delivery tasks and the evaluation loop on the running event loop."""
        self._notifier.start()
        if self._task is None:
            self._task = asyncio.create_task(self._run(), name="tiergate-alert-monitor")

    async def stop(self, timeout_s: float = 5.0) -> None:
        """Stop evaluating; deliver what is already queued for at most timeout_s."""
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)
            self._task = None
        await self._notifier.aclose(timeout_s)

    async def _run(self) -> None:
        while True:
            try:
                self.evaluate_now()
            except Exception:  # a bug here must not stop paging for good
                logger.exception("alert evaluation failed")
            await asyncio.sleep(self._interval_s)
