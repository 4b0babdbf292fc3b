"""The Starlette application of one replica: OpenAI routes, health, admin API and console,
metrics; the routes get everything through the GatewayRuntime."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable, Sequence

from starlette.applications import Starlette
from starlette.middleware import Middleware
from starlette.routing import BaseRoute

from gateway.admin.api import admin_routes
from gateway.admin.auth import AdminGuard
from gateway.batches.api import batch_routes
from gateway.files.api import files_routes
from gateway.http.errors import exception_handlers
from gateway.http.request_context import RequestContextMiddleware
from gateway.openai.routes import OpenAIApi, openai_routes
from gateway.server.health import health_routes
from gateway.server.runtime import GatewayRuntime

logger = logging.getLogger(__name__)


def build_app(
    runtime: GatewayRuntime,
    api: OpenAIApi,
    *,
    extra_routes: Sequence[BaseRoute] = (),
    middleware: Sequence[Middleware] = (),
    on_fatal: Callable[[BaseException], None] | None = None,
    admin_guard: AdminGuard | None = None,
) -> Starlette:
    """The app, its OpenAI routes served by api (the replica's one, which its batch runner
    shares); its lifespan loads the model in the background (ready when loaded) and
    closes the runtime at shutdown. on_fatal is called if the model cannot be loaded.
    middleware wraps the routes and the error handlers (inside the request-context
    middleware), so it sees the error responses they send. admin_guard: the one the
    extra routes' admin routes use (default: a guard of the admin API's own)."""

    @contextlib.asynccontextmanager
    async def lifespan(_app: Starlette) -> AsyncIterator[None]:
        loading = asyncio.create_task(runtime.start())

        def loaded(task: asyncio.Task[None]) -> None:
            if not task.cancelled() and task.exception() is not None and on_fatal:
                on_fatal(task.exception() or RuntimeError("model load failed"))

        loading.add_done_callback(loaded)
        try:
            yield
        finally:
            if not loading.done():
                loading.cancel()
            with contextlib.suppress(BaseException):
                await loading
            await runtime.close()

    routes: list[BaseRoute] = [
        *health_routes(runtime),
        *openai_routes(api),
        *files_routes(runtime, runtime.file_storage),
        *batch_routes(runtime, runtime.file_storage),
        # Before the admin API: its /admin/v1 mount would shadow other admin routes.
        *extra_routes,
        *admin_routes(
            session_factory=runtime.session_factory,
            admin_token=runtime.settings.admin_token,
            key_resolver=runtime.key_resolver,
            known_tiers=[tier.name for tier in runtime.tiers],
            adapters=runtime.adapters,
            served_models=lambda: {name: host.served for name, host in runtime.models.items()},
            unregister_timeout_s=runtime.settings.drain_timeout_s,
            guard=admin_guard,
        ),
    ]
    return Starlette(
        routes=routes,
        middleware=[Middleware(RequestContextMiddleware), *middleware],
        exception_handlers=exception_handlers(),
        lifespan=lifespan,
    )
