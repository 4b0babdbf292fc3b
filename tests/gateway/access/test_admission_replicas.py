"""Rate limits through three real `tiergate serve` replicas sharing one Redis (the local
server, under this run's own key prefix) and one PostgreSQL database: a tenant's limit holds
across them as if they were one. test_admission_single.py runs the same experiments on one
replica with the memory limiter, where they are exact.

Every bucket here refills at one unit a minute (rate 1, burst N), so what a test admits is
its burst: the refill over a test's seconds is below one unit, and allowed for.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

import migrations
from tests.gateway.admission_support import (
    SHARED_REDIS_URL,
    admit_n_of_3n,
    assert_openai_error,
    check_token_limit_under_concurrency,
    completion_body,
    create_key,
    create_tenant,
    create_tenant_id,
    delete_redis_prefix,
    new_key_prefix,
    post_completion,
    report,
    send_all,
    start_all,
    stop_all,
    write_config,
)
from tests.serve_process import ServeProcess
from tests.tenants.conftest import scratch_database

NUM_REPLICAS = 3
# The limit of the counting tests: 2 % of it is 2 requests.
N = 100


@pytest.fixture(scope="module")
def replicas(tmp_path_factory: pytest.TempPathFactory) -> Iterator[list[ServeProcess]]:
    directory = tmp_path_factory.mktemp("admission-replicas")
    prefix = new_key_prefix()
    admission = {
        # Shedding decisions depend on timing; these tests count rate-limit decisions only.
        "enable_shedding": False,
        "num_replicas": NUM_REPLICAS,
        "redis_key_prefix": prefix,
        # A loaded CI machine must not turn a slow Redis answer into a local fallback.
        "redis_timeout_s": 5.0,
    }
    config = write_config(directory / "replicas.json", {"admission": admission})
    with scratch_database("postgresql", directory) as database_url:
        migrations.upgrade_head(database_url)
        processes = [
            ServeProcess(
                database_url,
                args=["--no-migrate", "--redis-url", SHARED_REDIS_URL, "--config", str(config)],
            )
            for _ in range(NUM_REPLICAS)
        ]
        try:
            start_all(processes)
            yield processes
            for process in processes:
                # Every decision above went through Redis (no local fallback).
                assert "rate limiter unreachable" not in process.output(), process.output()
        finally:
            try:
                stop_all(processes)
            finally:
                for process in processes:
                    process.kill()
                delete_redis_prefix(SHARED_REDIS_URL, prefix)


@pytest.mark.parametrize("limit", ["requests", "tokens"])
def test_replicas_admit_n_of_3n_within_two_percent(
    replicas: list[ServeProcess], limit: str
) -> None:
    per_replica = admit_n_of_3n(replicas, limit, N)
    # One limit across the replicas: each answered 3N/3 = N requests, and N in all were
    # admitted. (How many each admitted depends on which replica this shared machine ran
    # first, so a stalled replica may admit none: that is not asserted.)
    assert abs(sum(per_replica) - N) <= 0.02 * N, per_replica


def test_concurrent_requests_on_replicas_never_overshoot_a_token_limit(
    replicas: list[ServeProcess],
) -> None:
    check_token_limit_under_concurrency(replicas, capacity=3000, concurrency_per_server=16)


def test_requests_together_on_replicas_never_spend_past_a_monthly_budget(
    replicas: list[ServeProcess],
) -> None:
    """Each request holds prompt + max_tokens (120) of the budget in Redis until its usage is
    counted, so the replicas together admit what one budget holds; with holds kept by each
    replica alone, each would admit 16 of its 16 requests."""
    budget = 2_000
    key = create_tenant(replicas[0], {"monthly_token_budget": budget})
    bodies = [completion_body(20, 100) for _ in range(16 * NUM_REPLICAS)]
    outcomes = send_all(replicas, key, bodies, concurrency_per_server=16)
    served = [o.payload["usage"]["total_tokens"] for o in outcomes if o.status_code == 200]
    refused = [o.payload["error"]["code"] for o in outcomes if o.status_code != 200]
    report(
        f"{len(bodies)} requests of up to 120 tokens at once on {NUM_REPLICAS} replicas, "
        f"budget {budget}: {len(served)} served, {sum(served)} tokens; {len(refused)} refused"
    )
    assert 0 < len(served) <= budget // 120 and sum(served) <= budget
    assert set(refused) <= {"rate_limit_exceeded", "insufficient_quota"}


def test_a_keys_own_limit_binds_before_its_tenants_on_every_replica(
    replicas: list[ServeProcess],
) -> None:
    """A key allowed 5 RPM under a tenant allowed 100: the replicas together serve it 5
    requests and refuse the rest naming the key's limit, while the tenant's other key,
    whose requests the key's refusals did not take from the tenant, still passes."""
    tenant_id = create_tenant_id(replicas[0], {"requests_per_minute": 100})
    capped = create_key(replicas[0], tenant_id, {"requests_per_minute": 5})
    other = create_key(replicas[0], tenant_id)
    outcomes = send_all(replicas, capped, [completion_body(4, 1) for _ in range(15)],
                        concurrency_per_server=5)
    served = [o for o in outcomes if o.status_code == 200]
    refused = [o for o in outcomes if o.status_code != 200]
    elapsed_s = max(o.sent_at_s for o in outcomes) - min(o.sent_at_s for o in outcomes)
    report(f"15 requests of a key allowed 5 RPM on {NUM_REPLICAS} replicas in "
           f"{elapsed_s:.1f} s: {len(served)} served")
    # the key's bucket refills one request in 12 s: exact unless sending took that long
    assert len(served) == 5 or (len(served) == 6 and elapsed_s >= 12)
    for outcome in refused:
        error = assert_openai_error(outcome, 429, "key_rate_limit_exceeded")
        assert "API key" in error["message"]
        # the headers show the limit that bound: the key's
        assert outcome.headers["x-ratelimit-limit-requests"] == "5"
        assert outcome.headers["x-ratelimit-remaining-requests"] == "0"
    for outcome in served:
        assert outcome.headers["x-ratelimit-limit-requests"] == "5"
    passed = post_completion(replicas[1], other, completion_body(4, 1))
    assert passed.status_code == 200, passed.payload
    # the tenant's bucket lost the served requests only (and refills meanwhile)
    assert passed.headers["x-ratelimit-limit-requests"] == "100"
    assert int(passed.headers["x-ratelimit-remaining-requests"]) >= 100 - len(served) - 1


def test_a_key_that_spent_its_own_budget_is_refused_naming_it(
    replicas: list[ServeProcess],
) -> None:
    """A key with a monthly budget of 300 tokens: two requests of 120 on two replicas use
    240; the third, on the third replica, cannot fit and is refused for good with the key's
    code; the tenant's other key is not concerned."""
    tenant_id = create_tenant_id(replicas[0], {"monthly_token_budget": 100_000})
    capped = create_key(replicas[0], tenant_id, {"monthly_token_budget": 300})
    other = create_key(replicas[0], tenant_id)
    for server in replicas[:2]:
        served = post_completion(server, capped, completion_body(20, 100))
        assert served.status_code == 200 and served.payload["usage"]["total_tokens"] == 120
    refused = post_completion(replicas[2], capped, completion_body(20, 100))
    error = assert_openai_error(refused, 429, "key_budget_exceeded")
    assert error["type"] == "insufficient_quota" and "API key" in error["message"]
    assert refused.headers["x-should-retry"] == "false"
    assert post_completion(replicas[2], other, completion_body(20, 100)).status_code == 200
