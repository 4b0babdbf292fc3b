"""An in-process gateway for tests that need to reach inside the running replica: the
composition `tiergate serve` makes (runtime, admission, observability, app) over a scratch
SQLite database, with the demo model's tokenizer driving a FakeModelRunner that sleeps its
modelled step time, served by uvicorn in a thread on a loopback port.

Tests talk to it over real HTTP and can slow the engine (``gateway.runner.extra_delay_s``),
read its metrics and swap in an in-memory span exporter through ``telemetry``.
"""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
import uvicorn
from starlette.types import ASGIApp

import migrations
import tenants
from engine.models.config import ModelConfig
from engine.process.async_engine import AsyncLLMEngine
from engine.testing.fake_runner import FakeModelRunner
from gateway.http.protocol import GatewayHttpProtocol
from gateway.observability.telemetry import Telemetry
from gateway.openai.chat_template import ChatTokenizer
from gateway.server.model_source import DEMO_MODEL
from gateway.server.model_spec import ModelSpec
from gateway.server.observability_wiring import Observability
from gateway.server.replica import compose_replica
from gateway.server.runtime import GatewayRuntime
from gateway.server.served_model import (
    ServedModel,
    describe_model,
    engine_config,
    new_engine,
)
from gateway.server.settings import GatewaySettings
from policies import TierTable
from tests.serve_process import ADMIN_TOKEN, shared_demo_model_dir

# KV blocks of the fake runner: plenty for the tests' prompts at 16 tokens a block.
_NUM_KV_BLOCKS = 1024
_KV_BLOCK_SIZE = 16


class FakeModelLoader:
    """A GatewayRuntime model loader: the demo checkpoint's tokenizer and config over a
    FakeModelRunner (real step sleeps, no weights). ``runner`` is set once loaded."""

    def __init__(self, model_dir: Path, num_kv_blocks: int = _NUM_KV_BLOCKS) -> None:
        self.model_dir = model_dir
        self.num_kv_blocks = num_kv_blocks
        self.runner: FakeModelRunner | None = None

    def __call__(
        self, settings: GatewaySettings, tiers: TierTable, spec: ModelSpec, created: int
    ) -> tuple[ServedModel, AsyncLLMEngine]:
        model_config = ModelConfig.from_file(self.model_dir)
        tokenizer = ChatTokenizer.from_dir(self.model_dir)
        # The fake's tokens are hashes of the context: keep them ids the tokenizer decodes.
        vocab_size = min(tokenizer.vocab_size, model_config.vocab_size)
        config = engine_config(settings, tiers, model_config, tokenizer, spec)
        config.cache.block_size = _KV_BLOCK_SIZE
        config.runner.num_kv_blocks = self.num_kv_blocks
        runner = FakeModelRunner(config, vocab_size=vocab_size, sleep=True)
        # The engine in a thread of this process, so tests can reach the fake runner.
        engine = AsyncLLMEngine(new_engine(settings, config, runner, model_config, tokenizer,
                                           background_priority=tiers.background_priority()))
        served = describe_model(
            model_config, tokenizer, spec.served_name, created, engine, vocab_size
        )
        self.runner = runner
        return served, engine


@dataclass
class InProcessGateway:
    """A running replica in this process; stop(), or leaving a `with` block on it, shuts it
    down (lifespan included)."""

    base_url: str
    runtime: GatewayRuntime
    observability: Observability
    loader: FakeModelLoader
    _server: uvicorn.Server = field(repr=False)
    _thread: threading.Thread = field(repr=False)
    _clients: list[openai.OpenAI] = field(default_factory=list, repr=False)

    @property
    def runner(self) -> FakeModelRunner:
        assert self.loader.runner is not None, "the model is not loaded yet"
        return self.loader.runner

    def admin(self) -> httpx.Client:
        return httpx.Client(
            base_url=self.base_url, headers={"x-admin-token": ADMIN_TOKEN}, timeout=30
        )

    def openai_client(self, api_key: str, **options: Any) -> openai.OpenAI:
        """The openai SDK on this replica, without retries; closed by stop() (a client left
        to the garbage collector warns of its unclosed sockets in a later test)."""
        client = openai.OpenAI(
            base_url=f"{self.base_url}/v1", api_key=api_key, max_retries=0, **options
        )
        self._clients.append(client)
        return client

    def create_tenant(
        self, name: str, tier: str, quota: Mapping[str, Any] | None = None
    ) -> tuple[int, str]:
        """A tenant made through the admin API: (its id, a fresh API key)."""
        with self.admin() as admin:
            created = admin.post(
                "/admin/v1/tenants", json={"name": name, "tier": tier, "quota": quota or {}}
            )
            assert created.status_code == 201, created.text
            tenant_id = int(created.json()["id"])
            key = admin.post(f"/admin/v1/tenants/{tenant_id}/keys", json={"name": "e2e"})
            assert key.status_code == 201, key.text
        return tenant_id, str(key.json()["key"])

    def stop(self, timeout_s: float = 30.0) -> None:
        for client in self._clients:
            client.close()
        self._server.should_exit = True
        self._thread.join(timeout_s)
        assert not self._thread.is_alive(), "uvicorn did not stop"

    def __enter__(self) -> InProcessGateway:
        return self

    def __exit__(self, *_exc_info: object) -> None:
        self.stop()


def start_gateway(
    work_dir: Path,
    *,
    file_config: Mapping[str, Any] | None = None,
    telemetry: Telemetry | None = None,
    tiers: TierTable | None = None,
    timeout_s: float = 60.0,
    wrap_app: Callable[[ASGIApp], ASGIApp] | None = None,
    database_url: str | None = None,
    send_buffer_bytes: int | None = None,
    **settings: Any,
) -> InProcessGateway:
    """Migrate a fresh SQLite database in work_dir (or database_url's, empty), compose the
    replica as serve does and
    serve it; returns once /health/ready answers 200. settings override GatewaySettings
    fields; file_config holds the config file's sections (admission, alerts); wrap_app wraps
    the app the server runs (an ASGI middleware of the test's); send_buffer_bytes sets the
    connections' kernel send buffer (small: a client that does not read blocks writes soon)."""
    database_url = database_url or f"sqlite:///{work_dir / 'tiergate.db'}"
    migrations.upgrade_head(database_url)
    listener = socket.socket()
    if send_buffer_bytes is not None:  # inherited by each accepted connection
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, send_buffer_bytes)
    listener.bind(("127.0.0.1", 0))
    port = int(listener.getsockname()[1])
    gateway_settings = GatewaySettings(
        host="127.0.0.1",
        port=port,
        database_url=database_url,
        admin_token=ADMIN_TOKEN,
        demo_model_dir=shared_demo_model_dir(),
        data_dir=work_dir / "data",
        file_config=dict(file_config or {}),
        **{"models": (ModelSpec(source=DEMO_MODEL),), **settings},
    )
    tier_table = tiers or TierTable()
    loader = FakeModelLoader(gateway_settings.demo_model_dir)
    db_engine = tenants.create_db_engine(tenants.DatabaseSettings(url=database_url))
    replica = compose_replica(
        gateway_settings, tier_table, db_engine, model_loader=loader, telemetry=telemetry
    )
    runtime, observability, app = replica.runtime, replica.observability, replica.app
    served_app: ASGIApp = app if wrap_app is None else wrap_app(app)
    server = uvicorn.Server(
        uvicorn.Config(served_app, host="127.0.0.1", port=port, log_level="warning",
                       lifespan="on", http=GatewayHttpProtocol)
    )
    thread = threading.Thread(
        target=server.run, kwargs={"sockets": [listener]}, name="uvicorn-e2e", daemon=True
    )
    thread.start()
    gateway = InProcessGateway(
        f"http://127.0.0.1:{port}", runtime, observability, loader, server, thread
    )
    _wait_ready(gateway, timeout_s)
    return gateway


def _wait_ready(gateway: InProcessGateway, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if not gateway._thread.is_alive():
            raise RuntimeError("the in-process gateway stopped while starting")
        try:
            ready = httpx.get(f"{gateway.base_url}/health/ready", timeout=2.0)
            if ready.status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.05)
    gateway.stop()
    raise RuntimeError(f"the in-process gateway was not ready in {timeout_s} s")
