"""Admin read-outs of the running replica for the console: GET /admin/v1/live (engine,
tiers and alerts in one poll) and GET /admin/v1/alerts.

Both are plain Routes with their full paths, so the app can list them next to the admin
API's Mount; both sit behind the AdminGuard.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable
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

    return [Route("/admin/v1/alerts", guard(list_alerts), methods=["GET"])]


def live_route(
    guard: AdminGuard,
    *,
    engine_stats: Callable[[], SchedulerStats],
    tiers: Iterable[Tier],
    monitor: AlertMonitor,
    clock: Callable[[], float] = time.time,
) -> Route:
    """GET /admin/v1/live: the KV pool, every tier's queues and TTFT, and the alerts.

    engine_stats returns the latest scheduler snapshot (EngineClient.stats); a tier's
    estimated_wait_s is the engine's estimate for a new request with an empty prompt.
    """
    tier_list = sorted(tiers, key=lambda tier: tier.priority)

    async def live(_request: Request) -> Response:
        stats = engine_stats()
        rows = []
        for tier in tier_list:
            tier_stats = stats.tiers.get(tier.priority)
            rule = monitor.rule(tier.name)
            rows.append(
                {
                    "tier": tier.name,
                    "priority": tier.priority,
                    "num_running": tier_stats.num_running if tier_stats else 0,
                    "num_waiting": tier_stats.num_waiting if tier_stats else 0,
                    "kv_blocks": tier_stats.num_kv_blocks if tier_stats else 0,
                    "kv_blocks_reserved": tier_stats.num_kv_blocks_reserved if tier_stats else 0,
                    "ttft_p99_s": monitor.p99_s(tier.name),
                    "ttft_slo_s": tier.ttft_slo_s,
                    "alert_threshold_s": rule.threshold_s if rule else None,
                    "estimated_wait_s": estimate_queue_wait_s(stats, tier.priority, 0),
                }
            )
        return JSONResponse(
            {
                "time": clock(),
                "kv_blocks_total": stats.num_kv_blocks_total,
                "kv_blocks_used": stats.num_kv_blocks_used,
                "prefix_cache_hit_ratio": stats.prefix_cache_hit_ratio,
                "tiers": rows,
                "alerts": [alert_json(s) for s in monitor.statuses()],
            }
        )

    return Route("/admin/v1/live", guard(live), methods=["GET"])
