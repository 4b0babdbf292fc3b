"""A client that leaves a non-streamed request: the engine stops generating for it (its KV
blocks come back), and the request is recorded as aborted with what it used."""

from __future__ import annotations

import time
from pathlib import Path

import httpx
from sqlalchemy import select

from billing import RecordStatus, UsageRecordRow
from gateway.server.model_source import DEMO_MODEL_NAME
from tests.gateway.app_harness import start_gateway


def test_a_client_that_leaves_a_non_streamed_request_aborts_it(tmp_path: Path) -> None:
    gateway = start_gateway(tmp_path)
    try:
        _, key = gateway.create_tenant("acme", "standard")
        body = {"model": DEMO_MODEL_NAME, "prompt": "a long story about", "max_tokens": 4000,
                "ignore_eos": True}
        started = time.monotonic()
        try:
            httpx.post(f"{gateway.base_url}/v1/completions", json=body, timeout=1.0,
                       headers={"authorization": f"Bearer {key}"})
        except httpx.ReadTimeout:
            pass  # the client leaves: its connection closes
        else:
            raise AssertionError("4,000 tokens of the demo model took under a second")
        deadline = time.monotonic() + 20
        while True:
            with gateway.runtime.session_factory() as session:
                rows = list(session.scalars(select(UsageRecordRow)))
            if rows:
                break
            assert time.monotonic() < deadline, "no record of the aborted request"
            time.sleep(0.05)
        assert [row.status for row in rows] == [RecordStatus.ABORTED]
        assert 0 < rows[0].num_completion_tokens < 4000
        assert time.monotonic() - started < 20  # not generated to the end
        with gateway.admin() as admin:
            assert admin.get("/admin/v1/live").json()["kv_blocks_used"] == 0
    finally:
        gateway.stop()
