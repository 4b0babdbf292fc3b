"""GET /health/live (the process answers, and no model's engine has been down for two
minutes) and GET /health/ready (it should get traffic: every model loaded or failed, one at
least with its engine running, not draining).

The database does not gate readiness: during an outage every replica shares it, the key
cache and the ledger's spool ride it out, and taking them all out of the Service would turn
an outage of billing into an outage of serving. Readiness still says whether it answers,
from a probe run at most once every ``DATABASE_PROBE_INTERVAL_S`` however often (and by
whomever, unauthenticated) readiness is polled.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable

import anyio.to_thread
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import BaseRoute, Route

from gateway.server.runtime import GatewayRuntime

DATABASE_PROBE_INTERVAL_S = 2.0


class DatabaseProbe:
    """The database's last answer, asked again in the background once it is interval_s old
    (one probe at a time; only the first caller waits for one). A probe still waiting after
    interval_s (a database that accepts and never answers) counts as no answer."""

    def __init__(
        self,
        answers: Callable[[], bool],
        *,
        interval_s: float = DATABASE_PROBE_INTERVAL_S,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self._answers = answers
        self._interval_s = interval_s
        self._clock = clock
        self._checked_at = -math.inf
        self._answer: bool | None = None
        self._probe: asyncio.Task[None] | None = None
        self._probe_started_at = -math.inf

    async def answers(self) -> bool:
        now = self._clock()
        is_stale = now - self._checked_at >= self._interval_s
        if is_stale and self._probe is None:
            self._probe_started_at = now
            self._probe = asyncio.get_running_loop().create_task(self._run())
        if self._answer is None:
            assert self._probe is not None
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(asyncio.shield(self._probe), self._interval_s)
        if self._probe is not None and self._clock() - self._probe_started_at >= self._interval_s:
            return False  # the probe waits on a database that does not answer
        return bool(self._answer)

    async def _run(self) -> None:
        try:
            self._answer = await anyio.to_thread.run_sync(self._answers)
            self._checked_at = self._clock()
        finally:
            self._probe = None


def health_routes(runtime: GatewayRuntime) -> list[BaseRoute]:
    database = DatabaseProbe(runtime.database_answers)

    async def live(_request: Request) -> Response:
        for model, engine in runtime.engine_health().items():
            if not engine.is_alive:  # restarts keep failing: replace the replica
                return JSONResponse(
                    {"status": "engine_down", "model": model,
                     "engine_down_for_s": round(engine.down_for_s or 0.0)},
                    status_code=503,
                )
        return JSONResponse({"status": "ok"})

    async def ready(_request: Request) -> Response:
        checks = {
            "model_loaded": runtime.is_model_loaded,
            "not_draining": not runtime.is_draining,
        }
        is_ready = all(checks.values())
        return JSONResponse(
            {
                "status": "ready" if is_ready else "not_ready",
                "checks": checks,
                # Each served model: loading, up, failed (the others serve) or restarting.
                "models": {name: host.state.value for name, host in runtime.models.items()},
                # Not a condition of readiness (see the module docstring).
                "database": await database.answers(),
            },
            status_code=200 if is_ready else 503,
        )

    return [
        Route("/health/live", live, methods=["GET", "HEAD"]),
        Route("/health/ready", ready, methods=["GET", "HEAD"]),
    ]
