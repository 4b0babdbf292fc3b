"""A tenant's max_queued_requests: its requests admitted on a replica and not yet started by
the engine are bounded; beyond it, 429 queue_full with a retry-after, counted as a rejection,
and the tenant's buckets untouched. Once a request starts, its place frees.

The replica runs in this process (tests/gateway/app_harness.py) with its engine slowed to
0.5 s a step, so a request sent while a step runs waits for the next one; the client is the
openai SDK.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import httpx
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families

from gateway.server.model_source import DEMO_MODEL_NAME
from tests.gateway.app_harness import start_gateway


def test_a_tenants_queue_is_bounded_and_frees_as_its_requests_start(tmp_path: Path) -> None:
    gateway = start_gateway(tmp_path)
    try:
        _, key = gateway.create_tenant("queuer", "standard", {"max_queued_requests": 1})
        _, other_key = gateway.create_tenant("other", "standard", {"max_queued_requests": 1})
        client = gateway.openai_client(key, timeout=30)
        warm_up = client.completions.create(model=DEMO_MODEL_NAME, prompt="hi", max_tokens=1)
        assert warm_up.choices
        gateway.runner.extra_delay_s = 0.5
        results: list[object] = []

        def send_first() -> None:
            results.append(
                client.completions.create(model=DEMO_MODEL_NAME, prompt="first", max_tokens=2)
            )

        first = threading.Thread(target=send_first)
        first.start()
        time.sleep(0.2)  # admitted, in its first 0.5 s step
        # The first has not produced an output yet: the tenant's queue is full.
        with pytest.raises(openai.RateLimitError) as full:
            client.completions.with_raw_response.create(
                model=DEMO_MODEL_NAME, prompt="second", max_tokens=2
            )
        assert full.value.code == "rate_limit_exceeded"
        assert "your limit is 1" in full.value.message
        assert float(full.value.response.headers["retry-after-ms"]) > 0
        # Another tenant's queue is its own.
        other = gateway.openai_client(other_key, timeout=30)
        assert other.completions.create(model=DEMO_MODEL_NAME, prompt="x", max_tokens=1).choices
        first.join(30)
        assert results, "the first request did not finish"
        # Its place is free again.
        assert client.completions.create(model=DEMO_MODEL_NAME, prompt="third", max_tokens=1)
        metrics = httpx.get(f"{gateway.base_url}/metrics", timeout=30).text
    finally:
        gateway.stop()
    rejections = {
        sample.labels["reason"]: sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "tiergate_rejections_total"
    }
    assert rejections == {"queue_full": 1.0}
