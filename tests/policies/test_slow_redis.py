"""Redis that stalls for 80-150 ms at a time (SIGSTOP, every 0.3 s, seeded), three replicas
at the production timeout (0.1 s), fail_open: an admission sent during a stall times out,
and Redis runs it once the stall ends. Each timed-out admission is cancelled in the
background (admit.lua's "cancel"), and each release that could not reach Redis is retried,
so the slots are given back instead of standing as ghosts until their leases expire. A
replica on its local share counts its Redis leases still running in it and, for a while,
the slots the other replicas held at its last Redis answer; it probes Redis again 0.1 s
after a failure (backing off to 1 s) rather than 1 s, and once Redis answers, its local
leases still running are adopted into Redis. Measured here, the same run three ways: none of
these ("without"), the settling alone ("settled", the code before the share changes), all
of them: ghost-lease seconds (Redis leases that no running request holds, releases under way
included, integrated over the run), the most requests admitted at once against the
concurrency limit, and the slot-seconds over the limit as a share of all slot-seconds held.

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
    slot_s: float  # slots held by requests, integrated over the run
    over_limit_s: float  # slots held beyond the limit, integrated over the run
    num_admitted: int
    num_timed_out_cancelled: int  # timed-out admissions that had run and were given back
    ghosts_at_end: int  # Redis leases left once every request had ended


async def _run(server: ThrowawayRedis, settle: bool, share: bool, seed: int) -> Run:
    direct = redis.asyncio.Redis.from_url(server.url, socket_timeout=5)
    await direct.flushall()
    config = RedisLimiterConfig(
        key_prefix=PREFIX, on_failure=FailurePolicy.FAIL_OPEN, num_replicas=NUM_REPLICAS,
        lease_ttl_s=LEASE_TTL_S, first_probe_s=0.1 if share else 1.0,
    )
    replicas = [RedisRateLimiter.from_url(server.url, config) for _ in range(NUM_REPLICAS)]
    for limiter in replicas:
        if not settle:  # skipped releases and timed-out admissions stay, and the local
            limiter._settle_soon = lambda *_args: None  # type: ignore[method-assign]
            limiter._held_count = lambda _tenant: 0  # share ignores the replica's Redis leases
        if not share:  # the local share ignores the other replicas, nothing is adopted, and
            # the first probe comes after 1 s (above)
            limiter._others_over_share = lambda *_args: 0  # type: ignore[method-assign]
            limiter._adopt_soon = lambda: None  # type: ignore[method-assign]
    limits = TenantLimits(max_concurrent_requests=MAX_CONCURRENT)
    rng = random.Random(seed)
    running: set[str] = set()  # lease ids of the requests holding a slot
    result = Run(0.0, 0, 0.0, 0.0, 0, 0, 0)
    stop = asyncio.Event()
    changed_at = time.monotonic()

    def count(delta: int) -> None:
        nonlocal changed_at
        now = time.monotonic()
        result.slot_s += len(running) * (now - changed_at)
        result.over_limit_s += max(0, len(running) - MAX_CONCURRENT) * (now - changed_at)
        changed_at = now
        result.max_admitted = max(result.max_admitted, len(running) + delta)

    async def client(limiter: RedisRateLimiter) -> None:
        while not stop.is_set():
            try:
                lease = await limiter.acquire("t", limits, 1)
            except RateLimited:
                await asyncio.sleep(0.02)
                continue
            count(+1)
            running.add(lease.lease_id)
            result.num_admitted += 1
            await asyncio.sleep(rng.uniform(*HOLD_S))
            count(-1)
            running.discard(lease.lease_id)
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
            ids = await direct.zrangebyscore(key, int(time.time() * 1000), "+inf")
            in_redis = len(ids)
            now = time.monotonic()
            ghosts = {i.decode() for i in ids} - running
            result.ghost_lease_s += len(ghosts) * (now - last)
            last = now
            if stop.is_set() and not running and in_redis == 0:
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


# Seeds of the runs compared for over-admission: one run's share moves a lot with where the
# stalls fall (0.22-0.86 of the settled run's over seeds 3-8), so the bound holds over three.
OVER_LIMIT_SEEDS = (3, 4, 5)


@pytest.mark.slow
def test_a_stalling_redis_leaves_no_ghost_slots_and_less_over_admission(
    throwaway_redis: ThrowawayRedis,
) -> None:
    seeds = OVER_LIMIT_SEEDS
    without = asyncio.run(_run(throwaway_redis, settle=False, share=False, seed=seeds[0]))
    settled = [asyncio.run(_run(throwaway_redis, settle=True, share=False, seed=seed))
               for seed in seeds]
    with_settle = [asyncio.run(_run(throwaway_redis, settle=True, share=True, seed=seed))
                   for seed in seeds]

    def row(name: str, run: Run, given_back: str) -> str:
        over = 100 * run.over_limit_s / run.slot_s
        return (
            f"| {name} | {run.ghost_lease_s:.1f} | {run.max_admitted} | {over:.1f} % | "
            f"{run.num_admitted} | {given_back} |"
        )

    rows = [row(f"without, seed {seeds[0]}", without, "-")]
    for seed, settled_run, with_run in zip(seeds, settled, with_settle, strict=True):
        rows.append(row(f"settled, seed {seed}", settled_run,
                        str(settled_run.num_timed_out_cancelled)))
        rows.append(row(f"with, seed {seed}", with_run, str(with_run.num_timed_out_cancelled)))
    print(
        f"\nRedis stalls of 80-150 ms every {STALL_EVERY_S} s, {NUM_REPLICAS} replicas, "
        f"timeout 0.1 s, concurrency limit {MAX_CONCURRENT}, lease ttl {LEASE_TTL_S} s:\n"
        f"| settling | ghost-lease seconds | most admitted at once | slot-seconds over the "
        f"limit | admitted | given back |\n|---|---|---|---|---|---|\n" + "\n".join(rows)
    )
    assert without.ghost_lease_s > 1.0  # the run does time admissions out after they ran
    assert with_settle[0].num_timed_out_cancelled > 0
    assert with_settle[0].ghost_lease_s < without.ghost_lease_s / 2
    assert all(run.ghosts_at_end == 0 for run in with_settle)
    # "without" over-admits less than it might: its ghosts hold slots no request uses
    assert (sum(run.over_limit_s for run in with_settle)
            < 0.75 * sum(run.over_limit_s for run in settled))
