"""A dead engine heals: `tiergate serve`'s engine process killed (SIGKILL) under load. The
streams in flight end with an engine error and are recorded; new requests get 503
engine_restarting until the engine is back, then are served; /health/live stays 200 while
it restarts; the restart is counted. In process, an engine loop that crashes is restarted
the same way, and a replica whose engine stays down is no longer alive.
"""

from __future__ import annotations

import json
import os
import signal
import time
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

import gateway.observability.engine_health as engine_health
from engine.process.async_engine import AsyncLLMEngine
from gateway.server.model_source import DEMO_MODEL_NAME
from tests.gateway.app_harness import start_gateway
from tests.gateway.serve_harness import billing_periods, detail_export
from tests.serve_process import ServeProcess, start_long_streams

NUM_STREAMS = 3


def _engine_pid(server_pid: int) -> int:
    """The engine's process: the serve process's child started by multiprocessing's spawn
    (not its resource tracker)."""
    found = []
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            stat = (entry / "stat").read_text()
            cmdline = (entry / "cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        parent = int(stat.rsplit(")", 1)[1].split()[1])
        if parent == server_pid and "spawn_main" in cmdline and "resource_tracker" not in cmdline:
            found.append(int(entry.name))
    assert len(found) == 1, found
    return found[0]


def _restarts(base_url: str) -> dict[str, float]:
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return {
        sample.labels.get("outcome", "up"): sample.value
        for family in text_string_to_metric_families(text)
        for sample in family.samples
        if sample.name in ("tiergate_engine_restarts_total", "tiergate_engine_up")
    }


def test_a_killed_engine_process_is_restarted_and_its_requests_are_recorded(
    tmp_path: Path,
) -> None:
    since = datetime.now(UTC)
    server = ServeProcess(f"sqlite:///{tmp_path / 'restart.db'}").start()
    try:
        assert server.process is not None
        key = server.printed_keys()[0]
        streams, threads = start_long_streams(server.base_url, key, NUM_STREAMS)
        engine_pid = _engine_pid(server.process.pid)
        os.kill(engine_pid, signal.SIGKILL)
        killed_at = time.monotonic()
        for thread in threads:
            thread.join(60)
        # Every stream ended with the engine's error, none with [DONE].
        for lines in streams:
            assert lines[-1] != "data: [DONE]"
            assert json.loads(lines[-1].removeprefix("data: "))["error"]["code"] == "engine_error"
        # Until the engine is back: 503 engine_restarting (liveness stays 200); then served.
        answers: list[int] = []
        while True:
            response = httpx.post(
                f"{server.base_url}/v1/chat/completions",
                headers={"authorization": f"Bearer {key}"},
                json={"model": DEMO_MODEL_NAME, "max_tokens": 2,
                      "messages": [{"role": "user", "content": "back?"}]},
                timeout=60,
            )
            answers.append(response.status_code)
            if response.status_code == 200:
                break
            assert response.status_code == 503, response.text
            assert response.json()["error"]["code"] == "engine_restarting"
            assert httpx.get(f"{server.base_url}/health/live", timeout=30).status_code == 200
            assert time.monotonic() - killed_at < 120, "the engine did not come back"
            time.sleep(0.1)
        restarted_s = time.monotonic() - killed_at
        assert _engine_pid(server.process.pid) != engine_pid
        assert _restarts(server.base_url) == {"up": 1.0, "restarted": 1.0, "failed": 0.0}
        ids = {json.loads(lines[0].removeprefix("data: "))["id"] for lines in streams}
        records = {r["request_id"]: r for r in detail_export(server, billing_periods(since))}
    finally:
        server.stop()
    print(f"\nengine killed with {NUM_STREAMS} streams in flight: served again after "
          f"{restarted_s:.1f} s ({len(answers) - 1} x 503 meanwhile)")
    # No request in flight is without its record.
    assert {records[i]["status"] for i in ids} == {"failed"}
    assert all(records[i]["num_completion_tokens"] > 0 for i in ids)


def test_a_crashed_engine_loop_is_restarted_in_process(tmp_path: Path) -> None:
    gateway = start_gateway(tmp_path)
    try:
        _, key = gateway.create_tenant("acme", "standard")
        client = gateway.openai_client(key, timeout=30)
        first = gateway.runtime.host().engine
        assert isinstance(first, AsyncLLMEngine)

        def crash() -> Any:
            raise RuntimeError("injected: the engine loop broke")

        first.engine.step = crash  # type: ignore[method-assign]
        with pytest.raises(openai.InternalServerError, match="engine failed"):
            client.completions.create(model=DEMO_MODEL_NAME, prompt="hi", max_tokens=2)
        deadline = time.monotonic() + 60
        while gateway.runtime.host().engine is first or not gateway.runtime.is_model_loaded:
            assert time.monotonic() < deadline, "no restart"
            time.sleep(0.05)
        assert client.completions.create(model=DEMO_MODEL_NAME, prompt="hi", max_tokens=2)
        health = gateway.runtime.host().health()
        assert (health.is_up, health.generation, health.num_restarts) == (True, 2, 1)
    finally:
        gateway.stop()


def test_a_replica_whose_engine_stays_down_is_not_alive(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(engine_health, "ENGINE_DOWN_LIVENESS_S", 1.0)
    gateway = start_gateway(tmp_path)
    try:
        def cannot_load(*_args: Any) -> Any:
            raise RuntimeError("injected: the accelerator is gone")

        gateway.runtime.host()._loader = cannot_load  # the restarts will fail
        assert gateway.runtime.host().engine is not None
        gateway.runtime.host().engine.shutdown()
        deadline = time.monotonic() + 30
        while (live := httpx.get(f"{gateway.base_url}/health/live", timeout=30)).status_code == 200:
            assert time.monotonic() < deadline, "still alive"
            time.sleep(0.1)
        assert live.status_code == 503 and live.json()["status"] == "engine_down"
        assert httpx.get(f"{gateway.base_url}/health/ready", timeout=30).status_code == 503
        assert _restarts(gateway.base_url)["failed"] >= 1
    finally:
        gateway.stop()
