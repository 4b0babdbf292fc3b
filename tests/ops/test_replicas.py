"""Scale-out (issue 11): three `tiergate serve` replicas (ops.local_cluster.LocalCluster) sharing
one scratch PostgreSQL database and the local Redis, under this run's own key prefix.

One mixed load runs once for the module (fixture `mixed_load`): two rate-limited tenants send
twice their limit round-robin over the replicas, a tenant without limits streams chat
completions through the round-robin proxy, and meanwhile replica 0's admin API revokes a key,
disables a tenant and edits a quota while probes ask every replica every POLL_INTERVAL_S.
The tests then check what the clients saw:

- rate limits hold across the replicas within 2 % (one Redis bucket per tenant);
- each admin change holds at once on replica 0 and on replicas 1 and 2 within the key cache
  TTL (gateway.access.auth.DEFAULT_KEY_CACHE_TTL_S), the bound ops/README.md states;
- the billing export holds every response a client saw exactly once, with the usage the
  client saw, and one refused record per 429: nothing lost, nothing twice.

The cluster's replicas start at the same moment on an empty database, each running the
migrations itself (LocalCluster each_replica_migrates): one schema, one demo tenant and one
printed key must come out of it. The bootstrap race that decides the key is also forced
deterministically on its own.
"""

from __future__ import annotations

import asyncio
import json
import math
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Iterator, Sequence
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
import pytest
from sqlalchemy import Engine, create_engine, func, inspect, select, text

import migrations
from billing.models import USAGE_RECORDS
from gateway.access.auth import DEFAULT_KEY_CACHE_TTL_S
from gateway.server.bootstrap import DEMO_TENANT_NAME, create_demo_tenant_if_empty
from ops.local_cluster import UPSTREAM_HEADER, LocalCluster, RoundRobinProxy
from tenants import (
    DEFAULT_TIERS,
    ApiKey,
    Base,
    DatabaseSettings,
    Tenant,
    create_db_engine,
    create_session_factory,
    create_tenant,
    looks_like_key,
)
from tests.gateway.admission_support import (
    MODEL,
    SERVER_START_TIMEOUT_S,
    SHARED_REDIS_URL,
    completion_body,
    delete_redis_prefix,
    new_key_prefix,
    write_config,
)
from tests.serve_process import ADMIN_TOKEN, shared_demo_model_dir
from tests.tenants.conftest import scratch_database

NUM_REPLICAS = 3
# Capacity of the rate-limited tenants' buckets (requests, or requests' worth of tokens); they
# refill at one unit a minute, so a test's seconds add at most a unit or two. 2 % of it is 2.
N = 100
NUM_PROMPT_TOKENS = 15  # with max_tokens 1: 16 tokens reserved and used per request
CONCURRENCY_PER_REPLICA = 4
NUM_STREAMS = 24
STREAM_CONCURRENCY = 4
# Propagation: probes are sent this often to each replica, for this long past the bound.
POLL_INTERVAL_S = 0.2
POLL_PAST_BOUND_S = 1.0
# The key cache expires an entry TTL seconds after it was loaded. Every replica's entry of a
# changed tenant was loaded before the change answered (committed), so a probe sent TTL after
# that must see the change; the small slack only absorbs timer granularity.
PROPAGATION_SLACK_S = 0.5
PROPAGATION_BOUND_S = DEFAULT_KEY_CACHE_TTL_S + PROPAGATION_SLACK_S
OLD_REQUESTS_PER_MINUTE = 6000
NEW_REQUESTS_PER_MINUTE = 3000
# Lets the load get going before the admin changes start.
CHANGES_DELAY_S = 1.0


def report(line: str) -> None:
    """A measured number for the test log (pytest -s shows it; -rA keeps it on pass)."""
    print(f"[replicas e2e] {line}", flush=True)


@dataclass(frozen=True)
class TenantKey:
    """A tenant made through the admin API, with its one key."""

    tenant_id: int
    api_key_id: int
    key: str  # the plaintext, for Authorization: Bearer


@dataclass(frozen=True)
class Observation:
    """One request as its client saw it."""

    tenant_id: int  # whose key sent it
    replica_index: int  # which replica answered
    status_code: int
    error_code: str | None  # the OpenAI error's code when refused
    response_id: str | None  # the completion's id (the ledger's request_id) when answered
    num_prompt_tokens: int  # usage as the answer reported it; 0 when refused
    num_completion_tokens: int
    limit_requests: str | None  # the x-ratelimit-limit-requests header, if any
    sent_at_s: float  # time.monotonic() when sent
    answered_at_s: float  # time.monotonic() when the answer had been read


@dataclass(frozen=True)
class Probe:
    """A probe sent after an admin change answered. A loaded replica may take seconds to get
    to a request, so the replica decided somewhere between sending and answering."""

    replica_index: int
    sent_s: float  # when it was sent, seconds after the change answered
    answered_s: float  # when its answer had been read, likewise
    is_applied: bool  # it saw the change (otherwise it saw the state before it)


@dataclass(frozen=True)
class Propagation:
    """An admin change made through replica 0 and the probes of every replica after it."""

    name: str  # what changed, for the report
    # How long before the change answered the caches were primed (sent): each replica's
    # entry then lives until at most TTL minus this after the change.
    primed_s: float
    probes: list[Probe]

    def of_replica(self, replica_index: int) -> list[Probe]:
        """That replica's probes, in the order they were sent (one at a time)."""
        return [p for p in self.probes if p.replica_index == replica_index]

    def switch_window_s(self, replica_index: int) -> tuple[float, float]:
        """When the replica started to apply the change, in seconds after it: no earlier
        than the last probe that saw the old state was sent, no later than the first probe
        that saw the new one was answered."""
        probes = self.of_replica(replica_index)
        earliest = max((p.sent_s for p in probes if not p.is_applied), default=0.0)
        latest = min(p.answered_s for p in probes if p.is_applied)
        return earliest, latest


@dataclass(frozen=True)
class MixedLoad:
    """What the module's one mixed load did and saw."""

    requests_limited: list[Observation]  # the tenant with a requests bucket of N
    tokens_limited: list[Observation]  # the tenant with a tokens bucket of N requests' worth
    streams: list[Observation]  # the unlimited tenant's chat streams, through the proxy
    propagations: list[Propagation]  # revocation, tenant disable, quota edit
    every_observation: list[Observation]  # everything any client sent, probes included
    limited_elapsed_s: float  # from the first to the last answer of the rate-limited load
    periods: list[str]  # the billing months (YYYY-MM) the load ran in


class Clients:
    """Sends requests to the replicas and keeps what every client saw."""

    def __init__(self, http: httpx.AsyncClient, urls: Sequence[str]) -> None:
        self.http = http
        self.urls = list(urls)
        self.seen: list[Observation] = []

    async def admin(self, method: str, path: str, body: Any = None) -> Any:
        """An admin call through replica 0; returns its JSON answer."""
        response = await self.http.request(
            method, f"{self.urls[0]}/admin/v1{path}", json=body,
            headers={"x-admin-token": ADMIN_TOKEN},
        )  # fmt: skip
        assert response.status_code in (200, 201), response.text
        return response.json()

    async def create_tenant(
        self, name: str, quota: dict[str, int], tier: str = "standard"
    ) -> TenantKey:
        tenant = await self.admin("POST", "/tenants", {"name": name, "tier": tier, "quota": quota})
        key = await self.admin("POST", f"/tenants/{tenant['id']}/keys", {"name": "e2e"})
        return TenantKey(tenant["id"], key["id"], key["key"])

    async def complete(
        self, replica_index: int, tenant: TenantKey, body: dict[str, Any]
    ) -> Observation:
        """A non-streamed /v1/completions on one replica."""
        sent_at_s = time.monotonic()
        response = await self.http.post(
            f"{self.urls[replica_index]}/v1/completions", json=body, headers=_auth(tenant)
        )
        return self._keep(tenant, replica_index, response, response.json(), sent_at_s)

    async def stream_chat(self, base_url: str, tenant: TenantKey, max_tokens: int) -> Observation:
        """A streamed chat completion with usage in its last chunk."""
        body = {
            "model": MODEL, "messages": [{"role": "user", "content": "Count to ten."}],
            "max_tokens": max_tokens, "stream": True, "stream_options": {"include_usage": True},
        }  # fmt: skip
        sent_at_s = time.monotonic()
        async with self.http.stream(
            "POST", f"{base_url}/v1/chat/completions", json=body, headers=_auth(tenant)
        ) as response:
            replica_index = self.urls.index(response.headers[UPSTREAM_HEADER])
            if response.status_code != 200:
                payload = json.loads(await response.aread())
                return self._keep(tenant, replica_index, response, payload, sent_at_s)
            chunks = [
                json.loads(line.removeprefix("data: "))
                async for line in response.aiter_lines()
                if line.startswith("data: ") and line != "data: [DONE]"
            ]
        assert len({c["id"] for c in chunks}) == 1, chunks
        # The usage chunk is last; an error event instead would have no usage and fail here.
        payload = {"id": chunks[0]["id"], "usage": chunks[-1]["usage"]}
        return self._keep(tenant, replica_index, response, payload, sent_at_s)

    async def models(self, replica_index: int, tenant: TenantKey) -> Observation:
        """GET /v1/models on one replica: authentication only, no engine, nothing billed (so
        not kept in seen)."""
        sent_at_s = time.monotonic()
        response = await self.http.get(
            f"{self.urls[replica_index]}/v1/models", headers=_auth(tenant)
        )
        error = None if response.status_code == 200 else response.json()["error"]["code"]
        return Observation(
            tenant.tenant_id, replica_index, response.status_code, error, None, 0, 0, None,
            sent_at_s, time.monotonic(),
        )  # fmt: skip

    def _keep(
        self,
        tenant: TenantKey,
        replica_index: int,
        response: httpx.Response,
        payload: dict[str, Any],
        sent_at_s: float,
    ) -> Observation:
        is_ok = response.status_code == 200
        observation = Observation(
            tenant_id=tenant.tenant_id,
            replica_index=replica_index,
            status_code=response.status_code,
            error_code=None if is_ok else payload["error"]["code"],
            response_id=payload["id"] if is_ok else None,
            num_prompt_tokens=payload["usage"]["prompt_tokens"] if is_ok else 0,
            num_completion_tokens=payload["usage"]["completion_tokens"] if is_ok else 0,
            limit_requests=response.headers.get("x-ratelimit-limit-requests"),
            sent_at_s=sent_at_s,
            answered_at_s=time.monotonic(),
        )
        self.seen.append(observation)
        return observation


def _auth(tenant: TenantKey) -> dict[str, str]:
    return {"authorization": f"Bearer {tenant.key}"}


async def send_round_robin(
    clients: Clients, tenant: TenantKey, bodies: Sequence[dict[str, Any]]
) -> list[Observation]:
    """Each body once, to replica i % NUM_REPLICAS, CONCURRENCY_PER_REPLICA at a time each."""
    gates = [asyncio.Semaphore(CONCURRENCY_PER_REPLICA) for _ in clients.urls]

    async def one(index: int, body: dict[str, Any]) -> Observation:
        replica_index = index % len(clients.urls)
        async with gates[replica_index]:
            return await clients.complete(replica_index, tenant, body)

    return await asyncio.gather(*(one(i, body) for i, body in enumerate(bodies)))


async def stream_through_proxy(
    clients: Clients, proxy_url: str, tenant: TenantKey
) -> list[Observation]:
    gate = asyncio.Semaphore(STREAM_CONCURRENCY)

    async def one(index: int) -> Observation:
        async with gate:
            return await clients.stream_chat(proxy_url, tenant, max_tokens=4 + index % 5)

    return await asyncio.gather(*(one(i) for i in range(NUM_STREAMS)))


async def watch_change(
    clients: Clients,
    name: str,
    tenant: TenantKey,
    change: Callable[[], Awaitable[Any]],
    is_applied: Callable[[Observation], bool],
    *,
    probe_with_models: bool,
) -> Propagation:
    """Prime every replica's key cache with tenant's key (GET /v1/models: authentication
    only, so the entries are loaded just before the change even under load), make the change
    through replica 0, then probe every replica until POLL_PAST_BOUND_S past
    PROPAGATION_BOUND_S, and end with a completion on each. Probes are /v1/models when
    probe_with_models (fine timing: no engine), else completions."""
    await asyncio.sleep(CHANGES_DELAY_S)
    primes = await asyncio.gather(*(clients.models(i, tenant) for i in range(len(clients.urls))))
    assert [primed.status_code for primed in primes] == [200] * len(primes), primes
    await change()
    changed_at_s = time.monotonic()
    stop_at_s = changed_at_s + PROPAGATION_BOUND_S + POLL_PAST_BOUND_S
    body = completion_body(NUM_PROMPT_TOKENS, 1)

    def as_probe(seen: Observation) -> Probe:
        return Probe(
            seen.replica_index, seen.sent_at_s - changed_at_s, seen.answered_at_s - changed_at_s,
            is_applied(seen),
        )  # fmt: skip

    async def probe(index: int) -> list[Probe]:
        probes: list[Probe] = []
        while not probes or probes[-1].sent_s < stop_at_s - changed_at_s:
            if probe_with_models:
                seen = await clients.models(index, tenant)
            else:
                seen = await clients.complete(index, tenant, body)
            probes.append(as_probe(seen))
            await asyncio.sleep(POLL_INTERVAL_S)
        # Past the bound, the generation route sees the change too.
        seen = await clients.complete(index, tenant, body)
        probes.append(as_probe(seen))
        return probes

    per_replica = await asyncio.gather(*(probe(i) for i in range(len(clients.urls))))
    primed_s = changed_at_s - min(primed.sent_at_s for primed in primes)
    return Propagation(name, primed_s, [p for probes in per_replica for p in probes])


def refused_with(code: str) -> Callable[[Observation], bool]:
    """is_applied for a change that turns the key away; anything but 200 or that 403 fails."""

    def is_applied(seen: Observation) -> bool:
        assert seen.status_code == 200 or (seen.status_code, seen.error_code) == (403, code), seen
        return seen.status_code == 403

    return is_applied


def has_requests_limit(limit: int) -> Callable[[Observation], bool]:
    """is_applied for the quota edit: answered, with the new limit in the headers."""

    def is_applied(seen: Observation) -> bool:
        assert seen.status_code == 200, seen
        assert seen.limit_requests in (str(OLD_REQUESTS_PER_MINUTE), str(limit)), seen
        return seen.limit_requests == str(limit)

    return is_applied


async def run_mixed_load(urls: Sequence[str]) -> MixedLoad:
    first_month = datetime.now(UTC).strftime("%Y-%m")
    timeout = httpx.Timeout(180.0)
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
    async with (
        httpx.AsyncClient(timeout=timeout, limits=limits, trust_env=False) as http,
        RoundRobinProxy(urls) as proxy,
    ):
        clients = Clients(http, urls)
        by_requests = await clients.create_tenant(
            "by-requests", {"requests_per_minute": 1, "burst_requests": N}
        )
        by_tokens = await clients.create_tenant(
            "by-tokens", {"tokens_per_minute": 1, "burst_tokens": N * (NUM_PROMPT_TOKENS + 1)}
        )
        streamer = await clients.create_tenant("streamer", {})
        # Premium: their probes go ahead of the standard load, so probes are frequent.
        revoked = await clients.create_tenant("revoked", {}, "premium")
        disabled = await clients.create_tenant("disabled", {}, "premium")
        edited = await clients.create_tenant(
            "edited", {"requests_per_minute": OLD_REQUESTS_PER_MINUTE}, "premium"
        )
        bodies = [completion_body(NUM_PROMPT_TOKENS, 1) for _ in range(2 * N)]

        async def limited_load() -> tuple[list[Observation], list[Observation], float]:
            start_s = time.monotonic()
            requests_limited, tokens_limited = await asyncio.gather(
                send_round_robin(clients, by_requests, bodies),
                send_round_robin(clients, by_tokens, bodies),
            )
            return requests_limited, tokens_limited, time.monotonic() - start_s

        limited, streams, *propagations = await asyncio.gather(
            limited_load(),
            stream_through_proxy(clients, proxy.url, streamer),
            watch_change(
                clients, "key revocation", revoked,
                lambda: clients.admin("POST", f"/keys/{revoked.api_key_id}/revoke"),
                refused_with("api_key_revoked"), probe_with_models=True,
            ),
            watch_change(
                clients, "tenant disable", disabled,
                lambda: clients.admin("POST", f"/tenants/{disabled.tenant_id}/disable"),
                refused_with("tenant_disabled"), probe_with_models=True,
            ),
            watch_change(
                clients, "quota edit", edited,
                lambda: clients.admin(
                    "PATCH", f"/tenants/{edited.tenant_id}",
                    {"quota": {"requests_per_minute": NEW_REQUESTS_PER_MINUTE}},
                ),
                # Only a completion shows the limits (x-ratelimit-* headers).
                has_requests_limit(NEW_REQUESTS_PER_MINUTE), probe_with_models=False,
            ),
        )  # fmt: skip
    last_month = datetime.now(UTC).strftime("%Y-%m")
    requests_limited, tokens_limited, limited_elapsed_s = limited
    return MixedLoad(
        requests_limited=requests_limited,
        tokens_limited=tokens_limited,
        streams=streams,
        propagations=propagations,
        every_observation=clients.seen,
        limited_elapsed_s=limited_elapsed_s,
        periods=sorted({first_month, last_month}),
    )


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalCluster]:
    directory = tmp_path_factory.mktemp("replicas")
    prefix = new_key_prefix()
    admission = {
        # Shedding depends on timing; these tests count rate-limit decisions only.
        "enable_shedding": False,
        "num_replicas": NUM_REPLICAS,
        "redis_key_prefix": prefix,
        # A loaded CI machine must not turn a slow Redis answer into a local fallback.
        "redis_timeout_s": 5.0,
    }
    config = write_config(directory / "replicas.json", {"admission": admission})
    env = {
        "TIERGATE_MODEL": str(shared_demo_model_dir()),
        "TIERGATE_SERVED_MODEL_NAME": MODEL,
        "TIERGATE_DEVICE": "cpu",
        "TIERGATE_KV_CACHE_BYTES": str(16 << 20),
        "TIERGATE_ADMIN_TOKEN": ADMIN_TOKEN,
        "TIERGATE_CONFIG": str(config),
    }
    with scratch_database("postgresql", directory) as database_url:
        # An empty database, and every replica migrates at its own start, all at once.
        replicas = LocalCluster(
            NUM_REPLICAS, database_url, SHARED_REDIS_URL, env,
            work_dir=directory / "cluster", start_timeout_s=SERVER_START_TIMEOUT_S,
            each_replica_migrates=True,
        )  # fmt: skip
        try:
            replicas.start()
            yield replicas
            logs = [path.read_text(errors="replace") for path in replicas.log_paths]
            assert replicas.stop() == [0] * NUM_REPLICAS  # each drained, then exited 0
            for log in logs:
                # Every decision went through Redis (no local fallback).
                assert "rate limiter unreachable" not in log, log[-4000:]
        finally:
            replicas.stop()
            delete_redis_prefix(SHARED_REDIS_URL, prefix)


@pytest.fixture(scope="module")
def mixed_load(cluster: LocalCluster) -> MixedLoad:
    load = asyncio.run(run_mixed_load(cluster.urls))
    report(
        f"{len(load.every_observation)} requests from clients, rate-limited load of "
        f"{4 * N} requests in {load.limited_elapsed_s:.1f} s"
    )
    return load


@pytest.mark.parametrize("limit", ["requests", "tokens"])
def test_rate_limits_hold_across_three_replicas_within_two_percent(
    mixed_load: MixedLoad, limit: str
) -> None:
    seen = mixed_load.requests_limited if limit == "requests" else mixed_load.tokens_limited
    admitted = [o for o in seen if o.status_code == 200]
    refused = [o for o in seen if o.status_code != 200]
    assert {(o.status_code, o.error_code) for o in refused} == {(429, "rate_limit_exceeded")}
    per_replica = [sum(o.replica_index == i for o in admitted) for i in range(NUM_REPLICAS)]
    # One unit a minute refills while the load runs.
    num_refilled = math.ceil(mixed_load.limited_elapsed_s / 60)
    report(
        f"{limit} limit N={N} over {NUM_REPLICAS} replicas: {len(admitted)} of {len(seen)} "
        f"admitted (per replica {per_replica}), refill allowance {num_refilled}"
    )
    assert N <= len(admitted) <= N + num_refilled
    assert abs(len(admitted) - N) <= 0.02 * N
    # The load really was spread: every replica answered the limited tenant (which of them
    # admitted depends on which this shared machine ran first).
    assert all(any(o.replica_index == i for o in seen) for i in range(NUM_REPLICAS))


@pytest.mark.parametrize("name", ["key revocation", "tenant disable", "quota edit"])
def test_an_admin_change_on_replica_0_holds_on_every_replica_within_the_key_cache_ttl(
    mixed_load: MixedLoad, name: str
) -> None:
    (propagation,) = [p for p in mixed_load.propagations if p.name == name]
    # The replica that made the change forgets its cached entry at once.
    assert all(p.is_applied for p in propagation.of_replica(0))
    for index in range(1, NUM_REPLICAS):
        probes = propagation.of_replica(index)
        assert probes[-1].sent_s > PROPAGATION_BOUND_S  # probed past the bound
        # Once applied, it stays applied.
        num_stale = sum(not p.is_applied for p in probes)
        assert all(p.is_applied for p in probes[num_stale:])
        earliest_s, latest_s = propagation.switch_window_s(index)
        report(
            f"{name}: replica {index} (cache primed {propagation.primed_s:.2f} s before the "
            f"change) applied it between {earliest_s:.2f} s and {latest_s:.2f} s after it "
            f"(bound {PROPAGATION_BOUND_S:.1f} s; probes took "
            f"{max(p.answered_s - p.sent_s for p in probes):.2f} s at most)"
        )
        # Every probe sent after the bound saw the change.
        assert earliest_s <= PROPAGATION_BOUND_S


def test_every_stream_through_the_proxy_was_answered_by_some_replica(
    mixed_load: MixedLoad,
) -> None:
    assert [o.status_code for o in mixed_load.streams] == [200] * NUM_STREAMS
    replicas = Counter(o.replica_index for o in mixed_load.streams)
    assert set(replicas) == set(range(NUM_REPLICAS)), replicas


def test_the_billing_export_is_the_union_of_what_every_client_saw(
    cluster: LocalCluster, mixed_load: MixedLoad
) -> None:
    records = []
    for period in mixed_load.periods:
        export = httpx.get(
            f"{cluster.urls[-1]}/admin/v1/billing/export",
            params={"period": period, "format": "jsonl", "detail": "true"},
            headers={"x-admin-token": ADMIN_TOKEN},
            timeout=60,
            trust_env=False,
        )
        assert export.status_code == 200, export.text
        records += [json.loads(line) for line in export.text.splitlines()]
    seen = mixed_load.every_observation
    answered = [o for o in seen if o.status_code == 200]
    assert len({o.response_id for o in answered}) == len(answered)
    served = [r for r in records if r["status"] != "refused"]
    # No loss, no duplicate: each answered request exactly once, nothing else served.
    exported = Counter(r["request_id"] for r in served)
    assert set(exported.values()) == {1}
    assert set(exported) == {o.response_id for o in answered}
    by_id = {r["request_id"]: r for r in served}
    for observation in answered:
        record = by_id[observation.response_id]
        assert record["status"] == "completed", record
        assert record["tenant_id"] == observation.tenant_id, record
        assert record["num_prompt_tokens"] == observation.num_prompt_tokens, record
        assert record["num_completion_tokens"] == observation.num_completion_tokens, record
    # Every 429 a client saw is counted, folded into records of a second per key; a 403
    # (before authentication passed) is not.
    refused: Counter[int] = Counter()
    for r in records:
        if r["status"] == "refused":
            refused[r["tenant_id"]] += r["num_requests"]
    assert refused == Counter(o.tenant_id for o in seen if o.status_code == 429)
    report(
        f"billing export: {len(records)} records = {len(answered)} answered + "
        f"{len(records) - len(served)} of {sum(refused.values())} refusals, over "
        f"{len(seen)} client requests "
        f"({sum(o.status_code == 403 for o in seen)} were 403)"
    )


def test_three_replicas_starting_together_on_an_empty_database_end_with_one_schema(
    cluster: LocalCluster,
) -> None:
    printed = [_printed_keys(path) for path in cluster.log_paths]
    # Exactly one replica created the demo tenant and printed its key; the others lost the
    # race (or came later) and printed nothing.
    assert sorted(len(keys) for keys in printed) == [0] * (NUM_REPLICAS - 1) + [1], printed
    (demo_key,) = [key for keys in printed for key in keys]
    for url in cluster.urls:  # the key works on every replica
        models = httpx.get(
            f"{url}/v1/models", headers={"authorization": f"Bearer {demo_key}"}, trust_env=False
        )
        assert models.status_code == 200, models.text
    engine = create_engine(cluster.database_url)
    try:
        with engine.connect() as connection:
            versions = connection.scalars(text("SELECT version_num FROM alembic_version"))
            assert list(versions) == [migrations.head_revision()]
            tables = inspect(connection).get_table_names()
            assert sorted(tables) == sorted({*Base.metadata.tables, "alembic_version"})
            assert USAGE_RECORDS.name in tables
            demo = connection.scalars(select(Tenant.id).where(Tenant.name == DEMO_TENANT_NAME))
            (demo_id,) = demo
            num_keys = connection.scalar(
                select(func.count()).select_from(ApiKey).where(ApiKey.tenant_id == demo_id)
            )
            assert num_keys == 1
    finally:
        engine.dispose()


def _printed_keys(log_path: Path) -> list[str]:
    """The tenant keys a replica printed (the first-run message shows the key on its own line)."""
    lines = log_path.read_text(errors="replace").splitlines()
    return [line.strip() for line in lines if looks_like_key(line.strip())]


def test_a_replica_that_loses_the_demo_tenant_race_creates_nothing_and_prints_no_key(
    tmp_path: Path,
) -> None:
    """The race itself, made certain: the winner has inserted the demo tenant but not
    committed when the loser, having counted no tenant, inserts its own and waits on the
    unique index; the winner commits; the loser gets the conflict and returns no key."""
    with scratch_database("postgresql", tmp_path) as database_url:
        migrations.upgrade_head(database_url)
        engine = create_db_engine(DatabaseSettings(url=database_url))
        session_factory = create_session_factory(engine)
        try:
            with ThreadPoolExecutor(1) as pool, session_factory.begin() as winner:
                create_tenant(winner, name=DEMO_TENANT_NAME, tier="standard", actor="test:winner")
                loser = pool.submit(create_demo_tenant_if_empty, session_factory, DEFAULT_TIERS)
                _wait_for_a_lock_wait(engine, loser)
                # Leaving the block commits the winner, which lets the loser's insert fail.
            assert loser.result(timeout=30) is None
            with session_factory() as session:
                assert session.scalars(select(Tenant.name)).all() == [DEMO_TENANT_NAME]
                assert session.scalar(select(func.count()).select_from(ApiKey)) == 0
        finally:
            engine.dispose()


def _wait_for_a_lock_wait(engine: Engine, blocked: Future[str | None]) -> None:
    """Return once a session of this database waits on a lock (the loser's insert)."""
    query = text(
        "SELECT count(*) FROM pg_stat_activity "
        "WHERE datname = current_database() AND wait_event_type = 'Lock'"
    )
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        assert not blocked.done(), blocked.result()  # it ended without waiting: no race
        with engine.connect() as connection:
            if connection.scalar(query):
                return
        time.sleep(0.05)
    raise AssertionError("the loser never waited on the winner's insert")
