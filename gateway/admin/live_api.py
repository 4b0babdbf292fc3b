"""Admin read-outs of the running replica for the console: GET /admin/v1/live (engine,
tiers and alerts in one poll) and GET /admin/v1/alerts.

Both are plain Routes with their full paths, so the app can list them next to the admin
API's Mount; both sit behind the AdminGuard.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Mapping
from typing import Any

from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from engine import SchedulerStats
from gateway.admin.auth import AdminGuard
from gateway.observability.alerting import AlertMonitor
from policies import AlertStatus, Tier, estimate_queue_wait_s


def alert_json(status: AlertStatus) -> dict[str, Any]:
    return {
        "name": status.name,
        "tier": status.tier,
        "state": status.state.value,
        "since": status.since_s,
        "value": status.value_s,
        "threshold": status.threshold_s,
    }


def alerts_routes(guard: AdminGuard, monitor: AlertMonitor) -> list[Route]:
    """GET /admin/v1/alerts -> {"alerts": [{name, tier, state, since, value, threshold}]}."""

    async def list_alerts(_request: Request) -> Response:
        return JSONResponse({"alerts": [alert_json(s) for s in monitor.statuses()]})

    return [guard.route("/admin/v1/alerts", list_alerts, "GET")]


def live_route(
    guard: AdminGuard,
    *,
    engine_stats: Callable[[], Mapping[str, SchedulerStats]],
    tiers: Iterable[Tier],
    monitor: AlertMonitor,
    clock: Callable[[], float] = time.time,
) -> Route:
    """GET /admin/v1/live -> the engines' state per tier (summed over the served models),
    each model's engine, the alerts, and the time.

    engine_stats returns each served model's latest scheduler snapshot (EngineClient.stats);
    a tier's estimated_wait_s is the longest of the engines' estimates for a new request with
    an empty prompt.
    """
    tier_list = sorted(tiers, key=lambda tier: tier.priority)

    async def live(_request: Request) -> Response:
        by_model = engine_stats()
        engines = list(by_model.values())
        rows = []
        for tier in tier_list:
            of_tier = [t for t in (s.tiers.get(tier.priority) for s in engines) if t is not None]
            rule = monitor.rule(tier.name)
            rows.append(
                {
                    "tier": tier.name,
                    "priority": tier.priority,
                    "num_running": sum(t.num_running for t in of_tier),
                    "num_waiting": sum(t.num_waiting for t in of_tier),
                    "kv_blocks": sum(t.num_kv_blocks for t in of_tier),
                    "kv_blocks_reserved": sum(t.num_kv_blocks_reserved for t in of_tier),
                    "ttft_p99_s": monitor.p99_s(tier.name),
                    "ttft_slo_s": tier.ttft_slo_s,
                    "alert_threshold_s": rule.threshold_s if rule else None,
                    "estimated_wait_s": max(
                        (estimate_queue_wait_s(s, tier.priority, 0) for s in engines),
                        default=0.0),
                }
            )
        num_blocks = sum(s.num_kv_blocks_total for s in engines)
        return JSONResponse(
            {
                "time": clock(),
                "kv_blocks_total": num_blocks,
                "kv_blocks_used": sum(s.num_kv_blocks_used for s in engines),
                # Each engine's ratio, weighted by its pool's size.
                "prefix_cache_hit_ratio": sum(
                    s.prefix_cache_hit_ratio * s.num_kv_blocks_total for s in engines
                ) / num_blocks if num_blocks else 0.0,
                "models": [_model_row(name, stats) for name, stats in by_model.items()],
                "tiers": rows,
                "alerts": [alert_json(s) for s in monitor.statuses()],
            }
        )

    return guard.route("/admin/v1/live", live, "GET")


def _model_row(name: str, stats: SchedulerStats) -> dict[str, Any]:
    return {
        "model": name,
        "num_running": sum(t.num_running for t in stats.tiers.values()),
        "num_waiting": sum(t.num_waiting for t in stats.tiers.values()),
        "kv_blocks_total": stats.num_kv_blocks_total,
        "kv_blocks_used": stats.num_kv_blocks_used,
        "mean_step_time_s": stats.mean_step_time_s,
    }
