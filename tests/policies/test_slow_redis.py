"""Redis that stalls for 80-150 ms at a time (SIGSTOP, every 0.3 s, seeded), three replicas
at the production timeout (0.1 s), fail_open: an admission sent during a stall times out,
and Redis runs it once the stall ends. Each timed-out admission is cancelled in the
background (admit.lua's "cancel"), and each release that could not reach Redis is retried,
so the slots are given back instead of standing as ghosts until their leases expire; and a
replica on its local share counts its Redis leases still running in it. Measured here, with
these and without them (the behaviour before; the same run otherwise): ghost-lease seconds
(Redis leases that no running request holds, releases under way included, integrated over
the run) and the most requests admitted at once against the concurrency limit.

(A proxy that delays every reply by as much never gets a command run: each timeout drops
the connection, and the next connection's handshake alone outlasts the timeout.)

Against a throwaway redis-server of the test's own.
"""

from __future__ import annotations

import asyncio
import random
import time
from dataclasses import dataclass

import pytest
import redis.asyncio

from policies import (
    FailurePolicy,
    LimiterBackend,
    RateLimited,
    RedisLimiterConfig,
    RedisRateLimiter,
    TenantLimits,
)
from tests.policies.conftest import ThrowawayRedis

NUM_REPLICAS = 3
MAX_CONCURRENT = 12
CLIENTS_PER_REPLICA = 8
TRAFFIC_S = 4.0
HOLD_S = (0.05, 0.25)
STALL_S = (0.08, 0.15)
STALL_EVERY_S = 0.3
LEASE_TTL_S = 6.0
PREFIX = "tiergate"


@dataclass
class Run:
    ghost_lease_s: float  # Redis leases held by no request, integrated over the run
    max_admitted: int  # most requests holding a slot at once, over the replicas
    num_admitted: int
    num_timed_out_cancelled: int  # timed-out admissions that had run and were given back
    ghosts_at_end: int  # Redis leases left once every request had ended


async def _run(server: ThrowawayRedis, cancel: bool, seed: int) -> Run:
    direct = redis.asyncio.Redis.from_url(server.url, socket_timeout=5)
    await direct.flushall()
    config = RedisLimiterConfig(
        key_prefix=PREFIX, on_failure=FailurePolicy.FAIL_OPEN, num_replicas=NUM_REPLICAS,
        lease_ttl_s=LEASE_TTL_S,
    )
    replicas = [RedisRateLimiter.from_url(server.url, config) for _ in range(NUM_REPLICAS)]
    if not cancel:  # the behaviour before: skipped releases and timed-out admissions stay,
        for limiter in replicas:  # and the local share ignores the replica's Redis leases
            limiter._settle_soon = lambda *_args: None  # type: ignore[method-assign]
            limiter._held_count = lambda _tenant: 0  # type: ignore[method-assign]
    limits = TenantLimits(max_concurrent_requests=MAX_CONCURRENT)
    rng = random.Random(seed)
    held_redis = 0  # leases in Redis that a request holds
    admitted = 0
    result = Run(0.0, 0, 0, 0, 0)
    stop = asyncio.Event()

    async def client(limiter: RedisRateLimiter) -> None:
        nonlocal held_redis, admitted
        while not stop.is_set():
            try:
                lease = await limiter.acquire("t", limits, 1)
            except RateLimited:
                await asyncio.sleep(0.02)
                continue
            is_redis = lease.backend is LimiterBackend.REDIS
            admitted += 1
            held_redis += is_redis
            result.num_admitted += 1
            result.max_admitted = max(result.max_admitted, admitted)
            await asyncio.sleep(rng.uniform(*HOLD_S))
            admitted -= 1
            held_redis -= is_redis
            await limiter.release(lease, 1)

    async def stall() -> None:
        while not stop.is_set():
            await asyncio.sleep(STALL_EVERY_S)
            server.pause()
            await asyncio.sleep(rng.uniform(*STALL_S))
            server.resume()

    async def watch() -> None:
        key = f"{PREFIX}:{{t}}:leases"
        last = time.monotonic()
        while True:
            in_redis = await direct.zcount(key, int(time.time() * 1000), "+inf")
            now = time.monotonic()
            result.ghost_lease_s += max(0, in_redis - held_redis) * (now - last)
            last = now
            if stop.is_set() and admitted == 0 and in_redis == 0:
                return
            if stop.is_set() and now > stopped_at + LEASE_TTL_S + 2:
                result.ghosts_at_end = in_redis
                return
            await asyncio.sleep(0.05)

    try:
        tasks = [
            asyncio.create_task(client(limiter))
            for limiter in replicas for _ in range(CLIENTS_PER_REPLICA)
        ]
        stopped_at = time.monotonic() + TRAFFIC_S
        watcher = asyncio.create_task(watch())
        staller = asyncio.create_task(stall())
        await asyncio.sleep(TRAFFIC_S)
        stop.set()
        await staller
        await asyncio.gather(*tasks)
        await watcher
        result.num_timed_out_cancelled = sum(r.num_cancelled_leases for r in replicas)
    finally:
        server.resume()
        for limiter in replicas:
            await limiter.aclose()
        await direct.aclose()
    return result


@pytest.mark.slow
def test_admissions_timed_out_on_a_stalling_redis_leave_no_ghost_slots(
    throwaway_redis: ThrowawayRedis,
) -> None:
    without = asyncio.run(_run(throwaway_redis, cancel=False, seed=3))
    with_cancel = asyncio.run(_run(throwaway_redis, cancel=True, seed=3))
    print(
        f"\nRedis stalls of 80-150 ms every {STALL_EVERY_S} s, {NUM_REPLICAS} replicas, "
        f"timeout 0.1 s, "
        f"concurrency limit {MAX_CONCURRENT}, lease ttl {LEASE_TTL_S} s:\n"
        f"| cancellation | ghost-lease seconds | most admitted at once | admitted | "
        f"given back |\n|---|---|---|---|---|\n"
        f"| without | {without.ghost_lease_s:.1f} | {without.max_admitted} | "
        f"{without.num_admitted} | - |\n"
        f"| with | {with_cancel.ghost_lease_s:.1f} | {with_cancel.max_admitted} | "
        f"{with_cancel.num_admitted} | {with_cancel.num_timed_out_cancelled} |"
    )
    assert without.ghost_lease_s > 1.0  # the run does time admissions out after they ran
    assert with_cancel.num_timed_out_cancelled > 0
    assert with_cancel.ghost_lease_s < without.ghost_lease_s / 2
    assert with_cancel.ghosts_at_end == 0
