"""Paging on TTFT: a sliding-window p99 per tier and the alert state machine over it.

Pure logic with an injected clock: the gateway feeds TTFTs, evaluates about once a second
and delivers the events; nothing here does I/O.

An alert's life: INACTIVE -> PENDING when the window's p99 goes over the threshold ->
FIRING once it has stayed over for ``for_s`` (one FIRE event) -> RESOLVED when the p99 is
back at or under the threshold (one RESOLVE event) -> PENDING on the next breach. A window
with fewer than ``min_samples`` TTFTs has no p99 and counts as not breached, as a Prometheus
rule whose expression returns nothing: a firing alert resolves when traffic stops.
"""

from __future__ import annotations

import enum
import math
from collections import deque
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from policies.errors import PolicyError
from policies.tiers import Tier

ALERT_NAME = "TiergateTTFTP99High"  # also the alert of ops/prometheus/alert_rules.yml
ALERT_QUANTILE = 0.99
DEFAULT_WINDOW_S = 300.0
DEFAULT_FOR_S = 60.0
DEFAULT_MIN_SAMPLES = 20
# Most samples a window keeps; past it the oldest go first (p99 over the newest ones).
DEFAULT_MAX_SAMPLES = 20_000
_RULE_FIELDS = ("threshold_s", "window_s", "for_s", "min_samples")


class AlertRuleError(PolicyError):
    """An alert rule (or its configuration) that does not validate."""


class SlidingWindowQuantile:
    """Samples of the last ``window_s`` seconds (at most ``max_samples``) and their quantiles."""

    def __init__(self, window_s: float, max_samples: int = DEFAULT_MAX_SAMPLES) -> None:
        if window_s <= 0:
            raise AlertRuleError(f"window_s must be > 0, got {window_s}")
        if max_samples < 1:
            raise AlertRuleError(f"max_samples must be >= 1, got {max_samples}")
        self.window_s = window_s
        self._samples: deque[tuple[float, float]] = deque(maxlen=max_samples)  # (time_s, value)

    def add(self, now_s: float, value: float) -> None:
        self._samples.append((now_s, value))

    def num_samples(self, now_s: float) -> int:
        self._evict(now_s)
        return len(self._samples)

    def quantile(self, now_s: float, q: float) -> float | None:
        """Nearest-rank quantile of the samples in the window; None when it is empty."""
        self._evict(now_s)
        if not self._samples:
            return None
        values = sorted(value for _, value in self._samples)
        rank = max(1, math.ceil(q * len(values)))
        return values[rank - 1]

    def _evict(self, now_s: float) -> None:
        oldest_s = now_s - self.window_s
        while self._samples and self._samples[0][0] <= oldest_s:
            self._samples.popleft()


@dataclass(frozen=True)
class TtftAlertRule:
    """Page when the tier's TTFT p99 over the window stays above threshold_s for for_s."""

    tier: str  # tier name, the alert's tier label
    threshold_s: float  # the p99 must go over this to breach
    window_s: float = DEFAULT_WINDOW_S  # sliding window the p99 is taken over
    for_s: float = DEFAULT_FOR_S  # how long a breach lasts before the alert fires
    min_samples: int = DEFAULT_MIN_SAMPLES  # fewer TTFTs in the window: no p99, no breach

    def __post_init__(self) -> None:
        if not self.threshold_s > 0:
            raise AlertRuleError(f"tier {self.tier}: threshold_s must be > 0")
        if not self.window_s > 0:
            raise AlertRuleError(f"tier {self.tier}: window_s must be > 0")
        if self.for_s < 0:
            raise AlertRuleError(f"tier {self.tier}: for_s must be >= 0")
        if self.min_samples < 1:
            raise AlertRuleError(f"tier {self.tier}: min_samples must be >= 1")


def rules_from_tiers(
    tiers: Iterable[Tier], overrides: Mapping[str, Mapping[str, Any]] | None = None
) -> list[TtftAlertRule]:
    """One rule per tier with a threshold: the tier's alert_ttft_p99_s unless overridden.

    overrides is the config's per-tier section, e.g. ``{"premium": {"threshold_s": 0.3,
    "window_s": 120, "for_s": 30, "min_samples": 50}}``; a tier without a default threshold
    gets a rule only if the override names one, and ``threshold_s: null`` turns one off.
    """
    by_name = {tier.name: tier for tier in tiers}
    overrides = overrides or {}
    unknown = set(overrides) - set(by_name)
    if unknown:
        raise AlertRuleError(f"alert rules for unknown tiers: {', '.join(sorted(unknown))}")
    rules = []
    for name, tier in by_name.items():
        override = dict(overrides.get(name) or {})
        extra = set(override) - set(_RULE_FIELDS)
        if extra:
            raise AlertRuleError(f"tier {name}: unknown alert fields {', '.join(sorted(extra))}")
        threshold_s = override.pop("threshold_s", tier.alert_ttft_p99_s)
        if threshold_s is None:
            continue
        try:
            rules.append(TtftAlertRule(name, float(threshold_s), **override))
        except TypeError as exc:
            raise AlertRuleError(f"tier {name}: {exc}") from exc
    return rules


class AlertState(enum.Enum):
    INACTIVE = "inactive"  # never breached, or a pending breach that recovered
    PENDING = "pending"  # over the threshold, not yet for for_s
    FIRING = "firing"  # paged
    RESOLVED = "resolved"  # fired, then recovered

    @property
    def is_firing(self) -> bool:
        return self is AlertState.FIRING


class AlertEventKind(enum.Enum):
    FIRE = "fire"
    RESOLVE = "resolve"


@dataclass(frozen=True)
class AlertEvent:
    """A notification to deliver: the alert started firing, or it resolved."""

    kind: AlertEventKind
    name: str  # alert name (ALERT_NAME)
    tier: str
    dedup_key: str  # the same for the FIRE and RESOLVE of one alert, across incidents
    value_s: float | None  # windowed p99 at the transition (None: too few samples)
    threshold_s: float
    window_s: float
    num_samples: int  # TTFTs in the window at the transition
    started_at_s: float  # clock time the alert started firing
    ended_at_s: float | None  # clock time it resolved; None for FIRE


@dataclass(frozen=True)
class AlertStatus:
    """One alert's current state, as /admin/v1/alerts and the metrics show it."""

    name: str
    tier: str
    state: AlertState
    since_s: float | None  # clock time the state was entered; None: inactive since start
    value_s: float | None  # windowed p99 at the latest evaluation
    threshold_s: float
    num_samples: int  # TTFTs in the window at the latest evaluation


@dataclass
class _Alert:
    rule: TtftAlertRule
    window: SlidingWindowQuantile
    state: AlertState = AlertState.INACTIVE
    since_s: float | None = None
    fired_at_s: float = 0.0
    value_s: float | None = None
    num_samples: int = 0


class AlertEvaluator:
    """Windows and state machines of a set of TTFT rules. Not thread-safe: callers lock.

    Tiers without a rule still get a window (of window_s) for their p99, and no alert.
    """

    def __init__(
        self,
        rules: Sequence[TtftAlertRule],
        *,
        replica: str,
        clock: Callable[[], float],
        window_s: float = DEFAULT_WINDOW_S,
        max_samples: int = DEFAULT_MAX_SAMPLES,
    ) -> None:
        if len({rule.tier for rule in rules}) != len(rules):
            raise AlertRuleError("at most one TTFT alert rule per tier")
        self.replica = replica
        self._clock = clock
        self._window_s = window_s
        self._max_samples = max_samples
        self._alerts = {
            rule.tier: _Alert(rule, SlidingWindowQuantile(rule.window_s, max_samples))
            for rule in rules
        }
        # Every tier's window, for the console's p99; a ruled tier's is its alert's.
        self._windows = {tier: alert.window for tier, alert in self._alerts.items()}

    @property
    def rules(self) -> list[TtftAlertRule]:
        return [alert.rule for alert in self._alerts.values()]

    def dedup_key(self, tier: str) -> str:
        return f"tiergate/{self.replica}/ttft_p99/{tier}"

    def observe(self, tier: str, ttft_s: float) -> None:
        """Record one request's TTFT."""
        window = self._windows.get(tier)
        if window is None:
            window = self._windows[tier] = SlidingWindowQuantile(self._window_s, self._max_samples)
        window.add(self._clock(), ttft_s)

    def evaluate(self) -> list[AlertEvent]:
        """Advance every alert to now; the FIRE and RESOLVE events of the transitions made."""
        now_s = self._clock()
        events = []
        for alert in self._alerts.values():
            event = self._step(alert, now_s)
            if event is not None:
                events.append(event)
        return events

    def statuses(self) -> list[AlertStatus]:
        return [
            AlertStatus(
                name=ALERT_NAME,
                tier=alert.rule.tier,
                state=alert.state,
                since_s=alert.since_s,
                value_s=alert.value_s,
                threshold_s=alert.rule.threshold_s,
                num_samples=alert.num_samples,
            )
            for alert in self._alerts.values()
        ]

    def p99_s(self, tier: str) -> float | None:
        """The tier's current windowed p99 (None: no samples in the window)."""
        window = self._windows.get(tier)
        return None if window is None else window.quantile(self._clock(), ALERT_QUANTILE)

    def _step(self, alert: _Alert, now_s: float) -> AlertEvent | None:
        rule = alert.rule
        alert.num_samples = alert.window.num_samples(now_s)
        alert.value_s = alert.window.quantile(now_s, ALERT_QUANTILE)
        is_breached = (
            alert.num_samples >= rule.min_samples
            and alert.value_s is not None
            and alert.value_s > rule.threshold_s
        )
        if is_breached and alert.state in (AlertState.INACTIVE, AlertState.RESOLVED):
            self._enter(alert, AlertState.PENDING, now_s)
        if alert.state is AlertState.PENDING:
            if not is_breached:
                self._enter(alert, AlertState.INACTIVE, now_s)
            elif alert.since_s is not None and now_s - alert.since_s >= rule.for_s:
                self._enter(alert, AlertState.FIRING, now_s)
                alert.fired_at_s = now_s
                return self._event(alert, AlertEventKind.FIRE, None)
        elif alert.state is AlertState.FIRING and not is_breached:
            self._enter(alert, AlertState.RESOLVED, now_s)
            return self._event(alert, AlertEventKind.RESOLVE, now_s)
        return None

    @staticmethod
    def _enter(alert: _Alert, state: AlertState, now_s: float) -> None:
        alert.state = state
        alert.since_s = now_s

    def _event(self, alert: _Alert, kind: AlertEventKind, ended_at_s: float | None) -> AlertEvent:
        return AlertEvent(
            kind=kind,
            name=ALERT_NAME,
            tier=alert.rule.tier,
            dedup_key=self.dedup_key(alert.rule.tier),
            value_s=alert.value_s,
            threshold_s=alert.rule.threshold_s,
            window_s=alert.rule.window_s,
            num_samples=alert.num_samples,
            started_at_s=alert.fired_at_s,
            ended_at_s=ended_at_s,
        )
