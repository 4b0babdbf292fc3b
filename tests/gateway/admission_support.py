"""Helpers for the end-to-end admission tests (tests/gateway/access/test_admission_*.py): config
files, replicas started side by side, tenants made through the admin API, load sent with
httpx, and the numbers printed for the report.
"""

from __future__ import annotations

import asyncio
import json
import math
import random
import secrets
import statistics
import time
from collections.abc import Iterable, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import redis

from tests.serve_process import ADMIN_TOKEN, ServeProcess

MODEL = "tiergate-demo"
REQUEST_LIMIT_HEADERS = {f"x-ratelimit-{k}-requests" for k in ("limit", "remaining", "reset")}
TOKEN_LIMIT_HEADERS = {f"x-ratelimit-{k}-tokens" for k in ("limit", "remaining", "reset")}
RATE_LIMIT_HEADERS = REQUEST_LIMIT_HEADERS | TOKEN_LIMIT_HEADERS
SHARED_REDIS_URL = "redis://127.0.0.1:6379/0"
# Generous for 2 shared CPU cores running several servers at once.
SERVER_START_TIMEOUT_S = 240.0


def write_config(path: Path, config: Mapping[str, Any]) -> Path:
    """A --config file (JSON is YAML too)."""
    path.write_text(json.dumps(config))
    return path


def start_all(processes: Sequence[ServeProcess]) -> list[ServeProcess]:
    """Start the replicas side by side (each start waits on imports and a model load)."""
    with ThreadPoolExecutor(len(processes)) as pool:
        started = list(pool.map(lambda p: p.start(SERVER_START_TIMEOUT_S), processes))
    return started


def stop_all(processes: Iterable[ServeProcess]) -> None:
    """SIGTERM each; a replica that does not exit 0 fails the test with its output."""
    failures = []
    for process in processes:
        if process.process is None:
            continue
        code = process.stop()
        if code != 0:
            failures.append(f"{process.base_url} exited {code}:\n{process.output()[-4000:]}")
    assert not failures, "\n".join(failures)


def new_key_prefix() -> str:
    return f"tiergate-test-{secrets.token_hex(6)}"


def delete_redis_prefix(url: str, prefix: str) -> None:
    """Remove a test run's keys from the shared Redis."""
    client = redis.Redis.from_url(url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


def create_tenant(
    server: ServeProcess, quota: Mapping[str, int | None], *, tier: str = "standard"
) -> str:
    """A new tenant with quota, through the admin API; returns its API key."""
    return create_key(server, create_tenant_id(server, quota, tier=tier))


def create_tenant_id(
    server: ServeProcess, quota: Mapping[str, int | None], *, tier: str = "standard"
) -> int:
    """A new tenant with quota and no key yet, through the admin API; returns its id."""
    created = httpx.post(
        f"{server.base_url}/admin/v1/tenants",
        json={"name": f"t-{secrets.token_hex(4)}", "tier": tier, "quota": dict(quota)},
        headers={"x-admin-token": ADMIN_TOKEN},
        timeout=30,
    )
    assert created.status_code == 201, created.text
    return int(created.json()["id"])


def create_key(
    server: ServeProcess, tenant_id: int, limits: Mapping[str, int | None] | None = None
) -> str:
    """A new API key of the tenant (limits: the key's own), through the admin API."""
    key = httpx.post(
        f"{server.base_url}/admin/v1/tenants/{tenant_id}/keys",
        json={"name": "e2e", **(limits or {})},
        headers={"x-admin-token": ADMIN_TOKEN},
        timeout=30,
    )
    assert key.status_code == 201, key.text
    return str(key.json()["key"])


def completion_body(
    num_prompt_tokens: int, max_tokens: int, prompt_seed: int | None = None, **extra: Any
) -> dict[str, Any]:
    """A /v1/completions body whose prompt is exactly num_prompt_tokens token ids and whose
    completion is exactly max_tokens (ignore_eos), so prompt + max_tokens is what it uses.

    Without prompt_seed every body has the same prompt, and all but the first are mostly
    prefix-cache hits; with one, the prompt is random tokens from that seed, so bodies of
    distinct seeds share no cached block and each prompt is computed."""
    if prompt_seed is None:
        prompt = [5 + i % 50 for i in range(num_prompt_tokens)]
    else:
        rng = random.Random(prompt_seed)
        prompt = [rng.randrange(5, 500) for _ in range(num_prompt_tokens)]
    return {
        "model": MODEL,
        "prompt": prompt,
        "max_tokens": max_tokens,
        "ignore_eos": True,
        **extra,
    }


@dataclass(frozen=True)
class Outcome:
    """One request sent by send_all."""

    server_index: int  # which of the servers it went to
    body: dict[str, Any]  # what was sent
    status_code: int
    headers: httpx.Headers
    payload: Any  # the JSON answer
    sent_at_s: float  # time.monotonic() when sent
    latency_s: float  # until the whole answer was read


def post_completion(server: ServeProcess, key: str, body: dict[str, Any]) -> Outcome:
    """One /v1/completions request, waited for."""
    sent_at_s = time.monotonic()
    response = httpx.post(
        f"{server.base_url}/v1/completions",
        json=body,
        headers={"authorization": f"Bearer {key}"},
        timeout=60,
    )
    return Outcome(
        0, body, response.status_code, response.headers, response.json(), sent_at_s,
        time.monotonic() - sent_at_s,
    )


async def _send_all(
    urls: Sequence[str],
    key: str,
    bodies: Sequence[dict[str, Any]],
    concurrency_per_server: int,
    path: str,
) -> list[Outcome]:
    gates = [asyncio.Semaphore(concurrency_per_server) for _ in urls]
    limits = httpx.Limits(max_connections=concurrency_per_server * len(urls) + 4)
    async with httpx.AsyncClient(
        timeout=120, limits=limits, headers={"authorization": f"Bearer {key}"}
    ) as client:

        async def one(index: int, body: dict[str, Any]) -> Outcome:
            server_index = index % len(urls)
            async with gates[server_index]:
                sent_at_s = time.monotonic()
                response = await client.post(f"{urls[server_index]}{path}", json=body)
                latency_s = time.monotonic() - sent_at_s
            return Outcome(
                server_index, body, response.status_code, response.headers, response.json(),
                sent_at_s, latency_s,
            )

        return await asyncio.gather(*(one(i, body) for i, body in enumerate(bodies)))


def send_all(
    servers: Sequence[ServeProcess],
    key: str,
    bodies: Sequence[dict[str, Any]],
    *,
    concurrency_per_server: int = 8,
    path: str = "/v1/completions",
) -> list[Outcome]:
    """Send each body once, round-robin over the servers, concurrency_per_server at a time
    on each; returns the outcomes in the order of bodies."""
    urls = [s.base_url for s in servers]
    return asyncio.run(_send_all(urls, key, bodies, concurrency_per_server, path))


def assert_openai_error(outcome: Outcome, status_code: int, code: str) -> dict[str, Any]:
    """The OpenAI error object of a refusal; returns its inner "error"."""
    assert outcome.status_code == status_code, (outcome.status_code, outcome.payload)
    error = outcome.payload["error"]
    assert set(error) == {"message", "type", "param", "code"}, error
    assert error["code"] == code, error
    return dict(error)


def quantiles_ms(samples_s: Sequence[float]) -> tuple[float, float, float]:
    """(p50, p99, max) in milliseconds."""
    ordered = sorted(samples_s)
    p50 = statistics.median(ordered)
    p99 = ordered[min(len(ordered) - 1, round(0.99 * (len(ordered) - 1)))]
    return p50 * 1000, p99 * 1000, ordered[-1] * 1000


def report(line: str) -> None:
    """A measured number for the test log (pytest -s shows it; -rA keeps it on pass)."""
    print(f"[admission e2e] {line}", flush=True)


# -- the counting experiments shared by the replica and single-replica tests ------------------


def count_admitted(outcomes: Sequence[Outcome], limit_words: str) -> int:
    """Admitted requests; every other one must be a 429 naming the limit, with a retry time."""
    refused = [o for o in outcomes if o.status_code != 200]
    for outcome in refused:
        error = assert_openai_error(outcome, 429, "rate_limit_exceeded")
        assert limit_words in error["message"], error
        assert int(outcome.headers["retry-after-ms"]) > 0
    return len(outcomes) - len(refused)


def admit_n_of_3n(
    servers: Sequence[ServeProcess], limit: str, n: int, tier: str = "standard"
) -> list[int]:
    """3n requests, round-robin over servers, for a tenant whose requests (or tokens) limit
    holds n requests and refills at one unit a minute; returns the admitted count per server."""
    num_prompt_tokens = 15  # with max_tokens 1: 16 tokens reserved and used per request
    if limit == "requests":
        quota = {"requests_per_minute": 1, "burst_requests": n}
        words = "requests per minute"
    else:
        quota = {"tokens_per_minute": 1, "burst_tokens": n * (num_prompt_tokens + 1)}
        words = "tokens per minute"
    key = create_tenant(servers[0], quota, tier=tier)
    bodies = [completion_body(num_prompt_tokens, 1) for _ in range(3 * n)]
    start_s = time.monotonic()
    outcomes = send_all(servers, key, bodies, concurrency_per_server=8)
    elapsed_s = time.monotonic() - start_s
    num_admitted = count_admitted(outcomes, words)
    # Every server answered its round-robin share (a 200, or a 429 naming the limit): with a
    # limit local to each, each would admit up to n of its share.
    assert [sum(o.server_index == i for o in outcomes) for i in range(len(servers))] == [
        len(range(i, len(bodies), len(servers))) for i in range(len(servers))
    ]
    per_server = [
        sum(o.status_code == 200 for o in outcomes if o.server_index == i)
        for i in range(len(servers))
    ]
    report(
        f"{len(servers)} replica(s), {limit} limit N={n}: {num_admitted} of {3 * n} admitted "
        f"(per replica {per_server}) in {elapsed_s:.1f} s"
    )
    return per_server


def check_token_limit_under_concurrency(
    servers: Sequence[ServeProcess],
    capacity: int,
    concurrency_per_server: int,
    tier: str = "standard",
) -> None:
    """Requests of random sizes, many at once, against a token limit of capacity (refilling
    at one token a minute): never over the limit, not even by one request's reservation, and
    nothing refused that would still have fitted at the end."""
    key = create_tenant(servers[0], {"tokens_per_minute": 1, "burst_tokens": capacity}, tier=tier)
    rng = random.Random(7)
    bodies = [completion_body(rng.randrange(8, 48), rng.randrange(1, 9)) for _ in range(160)]
    start_s = time.monotonic()
    outcomes = send_all(servers, key, bodies, concurrency_per_server=concurrency_per_server)
    elapsed_s = time.monotonic() - start_s
    count_admitted(outcomes, "tokens per minute")

    def reserved(outcome: Outcome) -> int:
        return len(outcome.body["prompt"]) + int(outcome.body["max_tokens"])

    admitted = [o for o in outcomes if o.status_code == 200]
    for outcome in admitted:
        usage = outcome.payload["usage"]
        # ignore_eos: each used exactly its reservation, so nothing was refunded
        assert usage["prompt_tokens"] + usage["completion_tokens"] == reserved(outcome)
    num_tokens_admitted = sum(reserved(o) for o in admitted)
    smallest_refused = min(reserved(o) for o in outcomes if o.status_code != 200)
    refill = math.ceil(elapsed_s / 60)
    report(
        f"{len(servers)} replica(s), token limit {capacity} under "
        f"{concurrency_per_server * len(servers)} concurrent: {len(admitted)} of {len(bodies)} "
        f"admitted reserving {num_tokens_admitted} tokens, smallest refused {smallest_refused}, "
        f"{elapsed_s:.1f} s"
    )
    assert num_tokens_admitted <= capacity + refill
    assert capacity - num_tokens_admitted < smallest_refused + refill
