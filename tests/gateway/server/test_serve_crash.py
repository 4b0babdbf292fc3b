"""kill -9 under load: `tiergate serve` dies (SIGKILL) at a seeded random moment while
streaming and non-streaming clients are busy, and is started again on the same database and
--data-dir. Every request whose client saw its end is in the detail export exactly once, with
the usage the client saw; requests cut off by the kill are billed at most once."""

from __future__ import annotations

import asyncio
import random
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest

from tests.gateway.serve_harness import (
    ClientRequest,
    Traffic,
    TrafficMix,
    assert_billed_exactly_once,
    billing_periods,
    cli_detail_export,
    detail_export,
    start_replica,
)
from tests.serve_process import ServeProcess
from tests.tenants.conftest import BACKENDS, scratch_database

SEED = 20261
NUM_ROUNDS = 3
NUM_CLIENTS = 8
# The kill comes this long after the first request finished (seeded uniform draw).
KILL_AFTER_S = (0.2, 3.0)
MIX = TrafficMix(stream_fraction=0.5, multi_sample_fraction=0.25, max_max_tokens=48)


async def _load_then_kill(traffic: Traffic, server: ServeProcess, kill_after_s: float) -> None:
    stop = asyncio.Event()
    clients = asyncio.create_task(traffic.run(stop))
    # From the first finished request on, so that every round has some to check.
    while not traffic.completed:
        assert not clients.done(), traffic.requests
        await asyncio.sleep(0.02)
    await asyncio.sleep(kill_after_s)
    await asyncio.to_thread(server.kill)  # SIGKILL: no drain, no ledger close
    stop.set()
    await clients


@pytest.mark.parametrize("backend", BACKENDS)
def test_kill_9_under_load_bills_every_finished_request_exactly_once(
    backend: str, tmp_path: Path
) -> None:
    rng = random.Random(SEED)
    since = datetime.now(UTC)
    data_dir = tmp_path / "data"
    seen: list[ClientRequest] = []
    exported: list[dict[str, Any]] = []
    with scratch_database(backend, tmp_path) as database_url:
        server = start_replica(database_url, data_dir)
        api_key = server.printed_keys()[0]
        try:
            for round_index in range(NUM_ROUNDS):
                kill_after_s = rng.uniform(*KILL_AFTER_S)
                traffic = Traffic(
                    server.base_url, api_key, num_clients=NUM_CLIENTS, seed=round_index, mix=MIX
                )
                asyncio.run(_load_then_kill(traffic, server, kill_after_s))
                seen += traffic.requests
                # The kill caught requests mid-flight, and some had finished before it.
                assert traffic.cut_off and traffic.completed, traffic.requests
                server = start_replica(database_url, data_dir)  # replays the spool, if any
                exported = detail_export(server, billing_periods(since))
                check = assert_billed_exactly_once(seen, exported)
                print(
                    f"\n{backend} round {round_index}: killed after {kill_after_s:.2f} s, "
                    f"{len(traffic.completed)} requests finished, {len(traffic.cut_off)} cut off; "
                    f"so far {check}"
                )
            assert server.stop() == 0, server.output()
            # `tiergate billing export` reads the very records the admin route streamed.
            by_id = {record["request_id"]: record for record in exported}
            cli_records = cli_detail_export(database_url, billing_periods(since))
            assert {record["request_id"]: record for record in cli_records} == by_id
        finally:
            server.kill()
