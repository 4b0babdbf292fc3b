"""Unauthenticated floods on `tiergate serve` (issue 36's last row): database queries per
request, measured from PostgreSQL's own counters.

A replica of the demo model on a fresh PostgreSQL database takes, from 32 client threads:
the same well-formed unknown key, distinct random well-formed keys, malformed keys, and
`GET /health/ready`, each `--requests` times; a tenant with a valid key meanwhile asks
`GET /v1/models` every 50 ms. Printed per flood: the statuses, the database's transactions
during it (`pg_stat_database`, the replica's whole traffic: ledger, probes and key lookups,
each with the pool's pre-ping; read 11 s after the flood, as backends report within 10 s of
going idle) per request, and the valid tenant's failures and slowest answer.

    PYTHONPATH=. .venv/bin/python ops/bench/unknown_keys.py [--requests 2000]

(from the repository root: it starts its replica with the test helper tests/serve_process.py).
"""

from __future__ import annotations

import argparse
import collections
import secrets
import string
import threading
import time
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import httpx
import psycopg

from tests.serve_process import ServeProcess

ADMIN_URL = "postgresql://postgres@127.0.0.1:5432/postgres"


def _transactions(database: str) -> int:
    with psycopg.connect(ADMIN_URL, autocommit=True) as connection:
        connection.execute("SELECT pg_stat_clear_snapshot()")
        row = connection.execute(
            "SELECT xact_commit + xact_rollback FROM pg_stat_database WHERE datname = %s",
            (database,),
        ).fetchone()
    assert row is not None
    return int(row[0])


def _random_key() -> str:
    lookup = "".join(secrets.choice(string.ascii_lowercase + string.digits) for _ in range(8))
    return f"tg-{lookup}_{secrets.token_urlsafe(32)}"


def _flood(
    name: str, send: Callable[[httpx.Client, int], int], base: str, valid: str, requests: int,
    database: str,
) -> str:
    """One flood from 32 threads while a valid tenant asks every 50 ms: its table row."""
    stop = threading.Event()
    victim: list[tuple[int, float]] = []

    def watch() -> None:
        with httpx.Client(base_url=base, timeout=30) as client:
            while not stop.is_set():
                started = time.perf_counter()
                status = client.get(
                    "/v1/models", headers={"authorization": f"Bearer {valid}"}).status_code
                victim.append((status, time.perf_counter() - started))
                time.sleep(0.05)

    statuses: collections.Counter[int] = collections.Counter()
    lock = threading.Lock()

    def worker(offset: int) -> None:
        with httpx.Client(base_url=base, timeout=30) as client:
            for i in range(offset, requests, 32):
                status = send(client, i)
                with lock:
                    statuses[status] += 1

    time.sleep(11.0)  # backends report their counters within 10 s of going idle
    before = _transactions(database)
    watcher = threading.Thread(target=watch)
    watcher.start()
    started = time.perf_counter()
    with ThreadPoolExecutor(32) as pool:
        list(pool.map(worker, range(32)))
    seconds = time.perf_counter() - started
    stop.set()
    watcher.join()
    time.sleep(11.0)
    spent = _transactions(database) - before - 1  # less the reading of "before"
    failed = sum(1 for status, _ in victim if status != 200)
    slowest = max((s for _, s in victim), default=0.0)
    shown = ", ".join(f"{count} x {status}" for status, count in sorted(statuses.items()))
    return (f"| {name} ({seconds:.1f} s) | {shown} | {spent / requests:.4f} ({spent}) | "
            f"{failed} of {len(victim)} / {1e3 * slowest:.0f} |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--requests", type=int, default=2000)
    args = parser.parse_args()
    database = f"tiergate_flood_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(ADMIN_URL, autocommit=True) as connection:
        connection.execute(f'CREATE DATABASE "{database}"')
    server = ServeProcess(
        f"postgresql+psycopg://postgres@127.0.0.1:5432/{database}",
        args=["--kv-cache-bytes", str(16 << 20)],
    ).start()
    try:
        valid = server.printed_keys()[0]
        base = server.base_url
        same_unknown = _random_key()
        floods: dict[str, Callable[[httpx.Client, int], int]] = {
            "one unknown key, again and again": lambda c, _: c.get(
                "/v1/models", headers={"authorization": f"Bearer {same_unknown}"}).status_code,
            "distinct random well-formed keys": lambda c, _: c.get(
                "/v1/models", headers={"authorization": f"Bearer {_random_key()}"}).status_code,
            "malformed keys": lambda c, i: c.get(
                "/v1/models", headers={"authorization": f"Bearer sk-{i:040d}"}).status_code,
            "GET /health/ready": lambda c, _: c.get("/health/ready").status_code,
        }
        print(f"unauthenticated floods, {args.requests} requests each from 32 threads, demo "
              f"model, PostgreSQL database {database}")
        print("| flood | statuses | database transactions per request | valid tenant: "
              "failed / slowest ms |")
        print("|---|---|---|---|")
        for name, send in floods.items():
            print(_flood(name, send, base, valid, args.requests, database))
    finally:
        server.stop()
        with psycopg.connect(ADMIN_URL, autocommit=True) as connection:
            connection.execute(f'DROP DATABASE IF EXISTS "{database}" WITH (FORCE)')


if __name__ == "__main__":
    main()
