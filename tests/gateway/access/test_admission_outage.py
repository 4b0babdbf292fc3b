"""Redis going away under two real `tiergate serve` replicas, and coming back.

The shared Redis of the machine is never touched: the replicas use a throwaway redis-server
of this module's own, on a free port, that the test kills and restarts on the same port. One
replica is fail_open (num_replicas 2: it falls back to half of each limit), the other
fail_closed (503). They share one PostgreSQL database.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import pytest

import migrations
from policies import RedisLimiterConfig
from tests.gateway.admission_support import (
    Outcome,
    assert_openai_error,
    completion_body,
    create_tenant,
    post_completion,
    quantiles_ms,
    report,
    start_all,
    stop_all,
    write_config,
)
from tests.policies.conftest import ThrowawayRedis
from tests.serve_process import ServeProcess
from tests.tenants.conftest import scratch_database

# A limiter that lost Redis tries it again this often (the default; the config keeps it).
PROBE_INTERVAL_S = RedisLimiterConfig().probe_interval_s
REDIS_TIMEOUT_S = 2.0  # while Redis is up, a stall of this shared machine must not trip it


@dataclass(frozen=True)
class Replicas:
    redis: ThrowawayRedis
    fail_open: ServeProcess  # admits within limit / 2 while Redis is away
    fail_closed: ServeProcess  # refuses with 503 while Redis is away


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Replicas]:
    directory = tmp_path_factory.mktemp("admission-outage")
    redis = ThrowawayRedis()
    redis.start()
    common = {"enable_shedding": False, "num_replicas": 2, "redis_timeout_s": REDIS_TIMEOUT_S}
    open_config = write_config(
        directory / "open.json", {"admission": {**common, "on_redis_failure": "fail_open"}}
    )
    closed_config = write_config(
        directory / "closed.json", {"admission": {**common, "on_redis_failure": "fail_closed"}}
    )
    try:
        with scratch_database("postgresql", directory) as database_url:
            migrations.upgrade_head(database_url)
            processes = [
                ServeProcess(
                    database_url,
                    args=["--no-migrate", "--redis-url", redis.url, "--config", str(config)],
                )
                for config in (open_config, closed_config)
            ]
            try:
                start_all(processes)
                yield Replicas(redis, *processes)
            finally:
                try:
                    stop_all(processes)
                finally:
                    for process in processes:
                        process.kill()
    finally:
        redis.kill()


def _limited_tenant(server: ServeProcess, burst: int) -> str:
    """A tenant whose requests bucket holds burst and refills at one a minute."""
    return create_tenant(server, {"requests_per_minute": 1, "burst_requests": burst})


def _is_admitted(server: ServeProcess, key: str) -> bool:
    return post_completion(server, key, completion_body(8, 1)).status_code == 200


def _statuses(outcomes: list[Outcome]) -> list[int]:
    return [o.status_code for o in outcomes]


def _shared_limit_holds(replicas: Replicas, burst: int) -> bool:
    """burst requests split over both replicas are admitted, and then neither admits more."""
    key = _limited_tenant(replicas.fail_open, burst)
    servers = (replicas.fail_open, replicas.fail_closed)
    first = [post_completion(servers[i % 2], key, completion_body(8, 1)) for i in range(burst)]
    more = [post_completion(server, key, completion_body(8, 1)) for server in servers]
    return _statuses(first) == [200] * burst and _statuses(more) == [429, 429]


class _Stream(threading.Thread):
    """A long streamed completion, read to its end in a thread."""

    def __init__(self, server: ServeProcess, key: str) -> None:
        super().__init__()
        self.server, self.key = server, key
        self.first_chunk = threading.Event()
        self.lines: list[str] = []
        self.status_code = 0

    def run(self) -> None:
        body = completion_body(16, 100, stream=True)
        with httpx.stream(
            "POST", f"{self.server.base_url}/v1/completions", json=body,
            headers={"authorization": f"Bearer {self.key}"}, timeout=120,
        ) as response:
            self.status_code = response.status_code
            for line in response.iter_lines():
                if line:
                    self.lines.append(line)
                    self.first_chunk.set()
        self.first_chunk.set()


def test_redis_outage_degrades_as_configured_and_heals(replicas: Replicas) -> None:
    servers = (replicas.fail_open, replicas.fail_closed)
    # Redis up: one limit across both replicas (each alone would still admit 5 more).
    assert _shared_limit_holds(replicas, burst=10)

    # Streams in flight on both replicas when Redis dies.
    stream_key = create_tenant(replicas.fail_open, {"requests_per_minute": 1000})
    streams = [_Stream(server, stream_key) for server in servers for _ in range(2)]
    for stream in streams:
        stream.start()
    for stream in streams:
        assert stream.first_chunk.wait(60)
    replicas.redis.kill()

    # fail_open: the local share of the limit, burst 20 / 2 replicas = 10.
    key = _limited_tenant(replicas.fail_open, burst=20)
    on_open = [post_completion(replicas.fail_open, key, completion_body(8, 1)) for _ in range(16)]
    assert _statuses(on_open) == [200] * 10 + [429] * 6, _statuses(on_open)
    for outcome in on_open[10:]:
        assert_openai_error(outcome, 429, "rate_limit_exceeded")
    # fail_closed: 503 with an OpenAI error body and a retry time.
    on_closed = [
        post_completion(replicas.fail_closed, key, completion_body(8, 1)) for _ in range(6)
    ]
    for outcome in on_closed:
        error = assert_openai_error(outcome, 503, "rate_limiter_unavailable")
        assert error["type"] == "service_unavailable", error
        assert int(outcome.headers["retry-after-ms"]) > 0
    refusals = [o for o in on_open + on_closed if o.status_code != 200]
    p50_ms, p99_ms, max_ms = quantiles_ms([o.latency_s for o in refusals])
    admitted_p50_ms, _, admitted_max_ms = quantiles_ms([o.latency_s for o in on_open[:10]])
    # No request hangs on the dead Redis: each waits at most about one Redis timeout.
    assert max(max_ms, admitted_max_ms) < 5000

    # The streams admitted before the outage end normally; both replicas are still up.
    for stream in streams:
        stream.join(120)
        assert stream.status_code == 200 and stream.lines[-1] == "data: [DONE]", stream.lines
    for server in servers:
        assert server.process is not None and server.process.poll() is None
        assert httpx.get(f"{server.base_url}/health/live", timeout=10).status_code == 200

    # Redis back on the same port (empty): within a few probe intervals both replicas use it
    # again and the limit is shared once more.
    replicas.redis.start()
    restarted_at_s = time.monotonic()
    probe_key = create_tenant(replicas.fail_open, {"requests_per_minute": 1000})
    deadline_s = restarted_at_s + 30
    while not _is_admitted(replicas.fail_closed, probe_key) and time.monotonic() < deadline_s:
        time.sleep(0.1)
    closed_back_s = time.monotonic() - restarted_at_s
    # the fail_open replica tries Redis on its first request after its probe interval
    for _ in range(round(2 * PROBE_INTERVAL_S / 0.2)):
        assert _is_admitted(replicas.fail_open, probe_key)
        time.sleep(0.2)
    assert _shared_limit_holds(replicas, burst=10)
    shared_again_s = time.monotonic() - restarted_at_s
    report(
        f"Redis killed with 4 streams in flight (all ended normally); while down "
        f"fail_open admitted {_statuses(on_open).count(200)}/16 (share 10 of 20), fail_closed "
        f"answered {_statuses(on_closed)}; refusals while down p50 {p50_ms:.1f} ms, "
        f"p99 {p99_ms:.1f} ms, max {max_ms:.1f} ms (admitted: p50 {admitted_p50_ms:.0f} ms, "
        f"max {admitted_max_ms:.0f} ms); after restart fail_closed admitted again in "
        f"{closed_back_s:.1f} s, one shared limit verified {shared_again_s:.1f} s after it "
        f"(after {2 * PROBE_INTERVAL_S:.0f} s of requests to the fail_open replica)"
    )
    assert closed_back_s < 10
    for server in servers:
        output = server.output()
        assert "Redis rate limiter unreachable" in output, output
        assert "Redis rate limiter reachable again" in output, output
