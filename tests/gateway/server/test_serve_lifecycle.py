"""`tiergate serve` start and stop: first run on an empty database, health, SIGTERM drain,
and clients that disconnect mid-stream."""

from __future__ import annotations

import asyncio
import contextlib
import json
import shlex
import signal
import sqlite3
import subprocess
import threading
import time
from pathlib import Path

import httpx
import pytest

from tests.serve_process import ADMIN_TOKEN, ServeProcess, start_long_streams

MODEL = "tiergate-demo"


def _curl_line(output: str) -> str:
    lines = [line for line in output.splitlines() if line.startswith("curl ")]
    assert len(lines) == 1, output
    return lines[0]


def test_first_run_creates_demo_tenant_and_the_curl_line_works(tmp_path: Path) -> None:
    url = f"sqlite:///{tmp_path / 'first.db'}"
    with ServeProcess(url).start() as first:
        curl = _curl_line(first.output())
        result = subprocess.run(shlex.split(curl), capture_output=True, text=True, timeout=60)
        body = json.loads(result.stdout)
        assert body["object"] == "chat.completion", result.stdout
        assert body["choices"][0]["message"]["content"]
        assert body["usage"]["completion_tokens"] > 0
    # A database with a tenant: nothing is created and no key is printed.
    with ServeProcess(url).start() as second:
        assert second.printed_keys() == []
        assert "curl " not in second.output()
        tenants = httpx.get(
            f"{second.base_url}/admin/v1/tenants", headers={"x-admin-token": ADMIN_TOKEN}
        ).json()
        assert [t["name"] for t in tenants["data"]] == ["demo"]


def test_sigterm_drains_in_flight_requests_then_exits_zero(tmp_path: Path) -> None:
    server = ServeProcess(f"sqlite:///{tmp_path / 'drain.db'}").start()
    key = server.printed_keys()[0]
    headers = {"authorization": f"Bearer {key}"}
    lines: list[str] = []
    first_chunk = threading.Event()

    def stream() -> None:
        # Long enough (seconds) to be still streaming while the drain is checked below, even
        # if this machine stalls meanwhile; well inside the 30 s drain timeout.
        body = {"model": MODEL, "prompt": "drain", "max_tokens": 1000, "ignore_eos": True,
                "stream": True}
        with httpx.stream("POST", f"{server.base_url}/v1/completions", json=body,
                          headers=headers, timeout=60) as response:
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    first_chunk.set()

    thread = threading.Thread(target=stream)
    thread.start()
    assert first_chunk.wait(60)
    assert server.process is not None
    server.process.send_signal(15)
    # Draining: new work is refused with 503, readiness drops, the stream goes on.
    deadline = time.monotonic() + 10
    status = 0
    while time.monotonic() < deadline:
        status = httpx.post(f"{server.base_url}/v1/completions", headers=headers,
                            json={"model": MODEL, "prompt": "x"}, timeout=30).status_code
        if status == 503:
            break
    assert status == 503
    assert httpx.get(f"{server.base_url}/health/ready", timeout=30).status_code == 503
    thread.join(60)
    assert lines[-1] == "data: [DONE]"
    chunks = [json.loads(line[6:]) for line in lines[:-1]]
    assert sum(bool(c["choices"][0]["finish_reason"]) for c in chunks) == 1
    assert server.process.wait(60) == 0


def test_a_thousand_disconnects_leave_no_kv_blocks_held(tmp_path: Path) -> None:
    # Shedding off: this test is about disconnects; a 429 would never reach mid-stream.
    config = tmp_path / "tiergate.yaml"
    config.write_text("admission:\n  enable_shedding: false\n")
    with ServeProcess(
        f"sqlite:///{tmp_path / 'disconnect.db'}", args=["--config", str(config)]
    ).start() as server:
        key = server.printed_keys()[0]
        asyncio.run(_disconnect_many(server.base_url, key, total=1000, concurrency=32))
        live = _wait_idle(server.base_url)
        assert live["kv_blocks_used"] == 0, live
        assert all(t["num_running"] == 0 and t["num_waiting"] == 0 for t in live["tiers"]), live


async def _disconnect_many(base_url: str, key: str, total: int, concurrency: int) -> None:
    body = {"model": MODEL, "prompt": "a long story about", "max_tokens": 2000,
            "ignore_eos": True, "stream": True}
    semaphore = asyncio.Semaphore(concurrency)
    num_mid_stream = 0
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base_url, timeout=120, limits=limits,
                                 headers={"authorization": f"Bearer {key}"}) as client:

        async def one() -> None:
            nonlocal num_mid_stream
            async with semaphore, client.stream("POST", "/v1/completions", json=body) as resp:
                assert resp.status_code == 200
                async for line in resp.aiter_lines():
                    if line.startswith("data: {"):
                        num_mid_stream += 1
                        break  # leaving the block closes the connection mid-stream

        await asyncio.gather(*(one() for _ in range(total)))
    assert num_mid_stream == total


def _wait_idle(base_url: str, timeout_s: float = 30) -> dict:
    deadline = time.monotonic() + timeout_s
    live: dict = {}
    while time.monotonic() < deadline:
        live = httpx.get(f"{base_url}/admin/v1/live", headers={"x-admin-token": ADMIN_TOKEN}).json()
        if live["kv_blocks_used"] == 0:
            return live
        time.sleep(0.2)
    return live


@pytest.mark.parametrize("num_signals", [1, 2])
def test_a_drain_cut_short_still_records_every_request(tmp_path: Path, num_signals: int) -> None:
    """SIGTERM with streams that outlast the drain timeout (1 s), or SIGTERM twice (exit
    without waiting): the streams end, and every one has its usage record."""
    database = tmp_path / "cut.db"
    server = ServeProcess(f"sqlite:///{database}", args=["--drain-timeout", "1"]).start()
    assert server.process is not None
    key = server.printed_keys()[0]
    streams, threads = start_long_streams(server.base_url, key, 3)
    server.process.send_signal(signal.SIGTERM)
    if num_signals == 2:
        time.sleep(0.3)
        server.process.send_signal(signal.SIGTERM)
    exit_code = server.process.wait(60)
    for thread in threads:
        thread.join(60)
    ids = {json.loads(lines[0].removeprefix("data: "))["id"] for lines in streams}
    with contextlib.closing(sqlite3.connect(database)) as db:
        recorded = dict(db.execute("SELECT request_id, status FROM usage_records").fetchall())
    print(f"\n{num_signals} SIGTERM(s), drain timeout 1 s: exit {exit_code}, records "
          f"{sorted(recorded[i] for i in ids if i in recorded)}")
    assert exit_code == 0, server.output()
    assert ids <= set(recorded), server.output()  # no request without its record
