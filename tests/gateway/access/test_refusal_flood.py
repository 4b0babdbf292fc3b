"""A flood of 429s against a replica: every refusal is counted in the ledger, in a row a second
per key rather than a row a refusal, and those of the last second are written at shutdown.

The replica runs in this process (tests/gateway/app_harness.py) over SQLite, clients over HTTP.
"""

from __future__ import annotations

import collections
import threading
import time
from pathlib import Path

import httpx
from sqlalchemy import func, select

from billing import RecordStatus, UsageRecordRow
from gateway.server.model_source import DEMO_MODEL_NAME
from tests.gateway.app_harness import InProcessGateway, start_gateway

NUM_THREADS = 4
NUM_PER_THREAD = 100


def _flood(gateway: InProcessGateway, key: str, per_thread: int) -> collections.Counter[int]:
    statuses: collections.Counter[int] = collections.Counter()
    lock = threading.Lock()
    body = {"model": DEMO_MODEL_NAME, "prompt": "hi", "max_tokens": 1}

    def send() -> None:
        with httpx.Client(base_url=gateway.base_url, timeout=30) as client:
            for _ in range(per_thread):
                status = client.post(
                    "/v1/completions", json=body, headers={"authorization": f"Bearer {key}"}
                ).status_code
                with lock:
                    statuses[status] += 1

    threads = [threading.Thread(target=send) for _ in range(NUM_THREADS)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(120)
    return statuses


def _refused(gateway: InProcessGateway, tenant_id: int) -> tuple[int, int]:
    """Refused rows of the tenant, and the refusals they stand for."""
    with gateway.runtime.session_factory() as session:
        rows, requests = session.execute(
            select(func.count(), func.coalesce(func.sum(UsageRecordRow.num_requests), 0)).where(
                UsageRecordRow.tenant_id == tenant_id,
                UsageRecordRow.status == RecordStatus.REFUSED,
            )
        ).one()
    return int(rows), int(requests)


def test_a_flood_of_429s_is_counted_in_a_row_a_second(tmp_path: Path) -> None:
    gateway = start_gateway(tmp_path)
    try:
        tenant_id, key = gateway.create_tenant("flooder", "standard", {"requests_per_minute": 1})
        started = time.monotonic()
        statuses = _flood(gateway, key, NUM_PER_THREAD)
        elapsed_s = time.monotonic() - started
        num_refused = NUM_THREADS * NUM_PER_THREAD - 1
        assert statuses == {200: 1, 429: num_refused}
        deadline = time.monotonic() + 10
        while (found := _refused(gateway, tenant_id))[1] < num_refused:
            assert time.monotonic() < deadline, found
            time.sleep(0.1)
    finally:
        gateway.stop()
    num_rows, num_requests = found
    print(f"\n{num_refused} refusals in {elapsed_s:.2f} s: {num_rows} ledger row(s)")
    assert num_requests == num_refused
    assert num_rows <= elapsed_s + 2  # one a second, and the flush after the last


def test_the_last_refusals_are_written_at_shutdown(tmp_path: Path) -> None:
    gateway = start_gateway(tmp_path)
    try:
        tenant_id, key = gateway.create_tenant("flooder", "standard", {"requests_per_minute": 1})
        statuses = _flood(gateway, key, 3)
    finally:
        gateway.stop()
    assert statuses == {200: 1, 429: NUM_THREADS * 3 - 1}
    assert _refused(gateway, tenant_id)[1] == NUM_THREADS * 3 - 1
