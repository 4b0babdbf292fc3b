"""What the server's engine did during a run: its step, preemption and lane counters from
/metrics, read before and after the run, the gateway process's full garbage collections
(the engine's process has its own, which show in its step time) and its event loop's late
heartbeats. They explain a run's figures (a configuration's lower
tokens/s as slower steps, or as work done twice after preemptions; a slow refusal or token
gap as a collection's pause or a held event loop) without a probe in the server."""

from __future__ import annotations

import math
from dataclasses import dataclass, fields

import httpx
from prometheus_client.parser import text_string_to_metric_families

__all__ = ["EngineActivity", "engine_activity_of", "read_engine_activity"]


@dataclass(frozen=True)
class EngineActivity:
    """Engine totals (since the server started, or over a run once subtracted)."""

    num_steps: int
    busy_s: float  # measured step time
    num_prompt_tokens: int  # computed (prefix-cache hits not included)
    num_generated_tokens: int
    num_preemptions: int
    num_recomputed_tokens: int  # computed again after preemptions
    num_lane_steps: int  # steps that carried only under-share tenants' prompts
    num_full_gcs: int  # the gateway process's full collections (generation 2)
    full_gc_s: float  # the time they held that process
    # event-loop heartbeats (one due every 10 ms) that woke more than LATE_BEAT_S late
    num_late_beats: int

    @property
    def mean_full_gc_s(self) -> float:
        return self.full_gc_s / self.num_full_gcs if self.num_full_gcs else math.nan

    def minus(self, earlier: EngineActivity) -> EngineActivity:
        return EngineActivity(
            *(getattr(self, f.name) - getattr(earlier, f.name) for f in fields(self))
        )

    @property
    def mean_step_s(self) -> float:
        return self.busy_s / self.num_steps if self.num_steps else math.nan

    @property
    def mean_generated_per_step(self) -> float:
        """Sequences a step carried to a new token, on average: the batch the steps decoded."""
        return self.num_generated_tokens / self.num_steps if self.num_steps else math.nan


# A heartbeat later than this held back whatever was due then past the bench's bound on a
# refusal's answer (a histogram bucket edge of tiergate_event_loop_lag_seconds).
LATE_BEAT_S = 0.05
_LAG = "tiergate_event_loop_lag_seconds"

# The sample behind each field: (name, its kind, generation or le label, or None).
_SAMPLES: dict[str, tuple[str, str | None]] = {
    "num_steps": ("tiergate_engine_steps_total", None),
    "busy_s": ("tiergate_engine_busy_seconds_total", None),
    "num_prompt_tokens": ("tiergate_engine_tokens_total", "prompt"),
    "num_generated_tokens": ("tiergate_engine_tokens_total", "generated"),
    "num_preemptions": ("tiergate_engine_preemptions_total", None),
    "num_recomputed_tokens": ("tiergate_engine_tokens_total", "recomputed"),
    "num_lane_steps": ("tiergate_engine_under_share_lane_steps_total", None),
    "num_full_gcs": ("tiergate_gc_pause_seconds_count", "2"),
    "full_gc_s": ("tiergate_gc_pause_seconds_sum", "2"),
    "num_late_beats": (f"{_LAG}_count", None),
}
_ON_TIME_BEATS = (f"{_LAG}_bucket", repr(LATE_BEAT_S))


def read_engine_activity(base_url: str) -> EngineActivity | None:
    """The engine's totals from the server's /metrics; None when it does not serve them (a
    server behind a proxy that hides /metrics, or one without these counters)."""
    with httpx.Client(timeout=30.0, trust_env=False) as client:
        response = client.get(f"{base_url}/metrics")
    return engine_activity_of(response.text) if response.status_code == 200 else None


def engine_activity_of(exposition: str) -> EngineActivity | None:
    """The engines' totals in a Prometheus text exposition (summed over the served models);
    None without every one of them."""
    values: dict[tuple[str, str | None], float] = {}
    for family in text_string_to_metric_families(exposition):
        for sample in family.samples:
            labels = sample.labels
            key = (sample.name, labels.get("kind", labels.get("generation", labels.get("le"))))
            values[key] = values.get(key, 0.0) + sample.value
    if any(key not in values for key in (*_SAMPLES.values(), _ON_TIME_BEATS)):
        return None

    def count(name: str) -> int:
        return int(values[_SAMPLES[name]])

    return EngineActivity(
        num_steps=count("num_steps"),
        busy_s=values[_SAMPLES["busy_s"]],
        num_prompt_tokens=count("num_prompt_tokens"),
        num_generated_tokens=count("num_generated_tokens"),
        num_preemptions=count("num_preemptions"),
        num_recomputed_tokens=count("num_recomputed_tokens"),
        num_lane_steps=count("num_lane_steps"),
        num_full_gcs=count("num_full_gcs"),
        full_gc_s=values[_SAMPLES["full_gc_s"]],
        num_late_beats=count("num_late_beats") - int(values[_ON_TIME_BEATS]),
    )
