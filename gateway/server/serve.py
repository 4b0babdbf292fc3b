"""Running one replica: migrate, bootstrap, build the runtime and app, serve with uvicorn,
and drain on SIGTERM."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
from types import FrameType

import uvicorn

import migrations
import tenants
from gateway.admin.auth import ADMIN_TOKEN_ENV, InvalidAdminTokenError, validate_admin_token
from gateway.http.protocol import GatewayHttpProtocol
from gateway.server.bootstrap import create_demo_tenant_if_empty, first_run_message
from gateway.server.replica import ReplicaConfigError, compose_replica
from gateway.server.runtime import GatewayRuntime
from gateway.server.served_model import ServedModel
from gateway.server.settings import GatewaySettings
from policies import TierTable, TierTableError

logger = logging.getLogger("tiergate.serve")

# Seconds uvicorn waits for connections after the drain before cancelling them.
_GRACEFUL_SHUTDOWN_S = 5.0
# Seconds an idle keep-alive connection is kept open (see serve()).
_KEEP_ALIVE_S = 75


class ServeError(Exception):
    """The replica cannot start; the message says why."""


def load_tiers(settings: GatewaySettings) -> TierTable:
    if settings.config is None or "tiers" not in settings.file_config:
        return TierTable()
    try:
        return TierTable.from_file(settings.config)
    except (TierTableError, TypeError, ValueError) as exc:
        raise ServeError(f"--config {settings.config}: tiers: {exc}") from None


def freeze_startup_heap() -> None:
    """Move every object alive after startup (modules, the tokenizer, the app) out of the
    cyclic garbage collector's reach. Without it each full collection walks them all, a
    pause of the event loop that showed as the slowest 429s and token gaps under load (the
    engine's process freezes its own heap once its model is loaded). Once per process,
    before the replica is ready."""
    gc.collect()
    gc.freeze()


def serve(settings: GatewaySettings, *, log_level: str = "info") -> int:
    """Serve until SIGTERM/SIGINT; returns the exit code."""
    if settings.admin_token is None:
        logger.warning("%s is not set: /admin opens only to admin credentials "
                       "(tiergate admin-credentials create), and is off while none exists",
                       ADMIN_TOKEN_ENV)
    else:
        try:
            validate_admin_token(settings.admin_token)
        except InvalidAdminTokenError as exc:
            raise ServeError(str(exc)) from None
    tiers = load_tiers(settings)
    if settings.run_migrations:
        logger.info("migrating the database to head")
        try:
            migrations.upgrade_head(settings.database_url)
        except Exception as exc:
            raise ServeError(f"cannot migrate {_safe_url(settings.database_url)}: {exc}") from exc
    db_engine = tenants.create_db_engine(tenants.DatabaseSettings(url=settings.database_url))
    server: _DrainingServer | None = None
    failure: list[BaseException] = []

    def fatal(exc: BaseException) -> None:
        failure.append(exc)
        if server is not None:
            server.should_exit = True

    try:
        replica = compose_replica(settings, tiers, db_engine, on_fatal=fatal)
    except ReplicaConfigError as exc:
        raise ServeError(f"--config {settings.config}: {exc}") from None
    runtime, app = replica.runtime, replica.app
    demo_key = create_demo_tenant_if_empty(runtime.session_factory, [t.name for t in tiers])
    config = uvicorn.Config(
        app,
        host=settings.host,
        port=settings.port,
        log_level=log_level,
        lifespan="on",
        # Named rather than "auto" (which falls back to h11 and asyncio when these are
        # missing): h11 and the asyncio loop cost a refused request more server CPU than
        # httptools and uvloop, CPU the engine's steps share (ops/bench/journal.md, "The
        # server's HTTP parser and event loop").
        loop="uvloop",
        http=GatewayHttpProtocol,  # httptools, bounded send buffers, resets
        # Idle keep-alive connections stay open past the longest wait a 429 asks for and past
        # a load balancer's usual idle timeout (60 s): with uvicorn's 5 s, a client retrying
        # after `retry-after-ms` near 5 s raced the server's close of its pooled connection
        # and got "server disconnected" instead of its answer.
        timeout_keep_alive=_KEEP_ALIVE_S,
        timeout_graceful_shutdown=int(_GRACEFUL_SHUTDOWN_S),
    )
    server = _DrainingServer(config, runtime, settings.drain_timeout_s)

    def loaded(served: list[ServedModel]) -> None:
        if demo_key is not None:
            print(first_run_message(_base_url(settings), served[0].name, demo_key), flush=True)
        freeze_startup_heap()

    runtime.on_loaded = loaded
    server.run()
    if failure:
        raise ServeError(f"no model could be loaded: {failure[0]}")
    return 0


class _DrainingServer(uvicorn.Server):
    """uvicorn.Server whose first SIGTERM/SIGINT drains the runtime before exiting (exit
    status 0, no re-raised signal); a second one stops waiting for the requests in flight,
    which end at once (the engine stops) and are still recorded before the ledger closes."""

    def __init__(self, config: uvicorn.Config, runtime: GatewayRuntime, drain_s: float) -> None:
        super().__init__(config)
        self.runtime = runtime
        self.drain_s = drain_s
        self._loop: asyncio.AbstractEventLoop | None = None
        self._draining = False
        self._tasks: set[asyncio.Task[None]] = set()

    async def serve(self, sockets: list[socket.socket] | None = None) -> None:
        self._loop = asyncio.get_running_loop()
        await super().serve(sockets)

    def handle_exit(self, sig: int, frame: FrameType | None) -> None:
        if self._draining or self._loop is None:
            self.should_exit = True
            self.force_exit = self._draining
            return
        self._draining = True
        logger.info("received %s: draining", signal.Signals(sig).name)
        self._loop.call_soon_threadsafe(self._start_drain)

    def _start_drain(self) -> None:
        task = asyncio.ensure_future(self._drain_then_exit())
        self._tasks.add(task)
        task.add_done_callback(self._tasks.discard)

    async def _drain_then_exit(self) -> None:
        await self.runtime.drain(self.drain_s)
        self.should_exit = True

    async def shutdown(self, sockets: list[socket.socket] | None = None) -> None:
        await super().shutdown(sockets)
        if self.force_exit:
            # uvicorn skips the app's shutdown on a forced exit; it is where the requests in
            # flight are ended and recorded and the ledger flushed, so it runs all the same.
            await self.lifespan.shutdown()


def _base_url(settings: GatewaySettings) -> str:
    host = "127.0.0.1" if settings.host in ("0.0.0.0", "::", "") else settings.host
    return f"http://{host}:{settings.port}"


def _safe_url(url: str) -> str:
    from sqlalchemy.engine import make_url

    return make_url(url).render_as_string(hide_password=True)
