"""GET /health/live (the process answers) and GET /health/ready (it should get traffic:
model loaded, database reachable, not draining)."""

from __future__ import annotations

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.runtime import GatewayRuntime


def health_routes(runtime: GatewayRuntime) -> list[BaseRoute]:
    async def live(_request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def ready(_request: Request) -> Response:
        checks = {
            "model_loaded": runtime.is_model_loaded,
            "database": await anyio.to_thread.run_sync(runtime.database_answers),
            "not_draining": not runtime.is_draining,
        }
        is_ready = all(checks.values())
        return JSONResponse(
            {"status": "ready" if is_ready else "not_ready", "checks": checks},
            status_code=200 if is_ready else 503,
        )

    return [
        Route("/health/live", live, methods=["GET", "HEAD"]),
        Route("/health/ready", ready, methods=["GET", "HEAD"]),
    ]
