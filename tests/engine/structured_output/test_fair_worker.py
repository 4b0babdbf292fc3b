"""FairWorker: jobs take turns between keys; PartitionedLru: a partition evicts only its own."""

from __future__ import annotations

import threading

import pytest

from engine.structured_output.fair_worker import FairWorker
from engine.structured_output.partitioned_lru import PartitionedLru


def test_keys_take_turns_and_each_keys_jobs_keep_their_order() -> None:
    worker = FairWorker("test-fair")
    gate = threading.Event()
    ran: list[str] = []
    blocker = worker.submit("warm", gate.wait)  # holds the thread while the queues fill
    futures = [worker.submit("heavy", lambda i=i: ran.append(f"heavy{i}")) for i in range(50)]
    futures.append(worker.submit("light", lambda: ran.append("light")))
    futures += [worker.submit("other", lambda i=i: ran.append(f"other{i}")) for i in range(2)]
    gate.set()
    blocker.result(timeout=10)
    for future in futures:
        future.result(timeout=10)
    # Round robin over the keys waiting: light's one job runs second, not 51st.
    assert ran[:5] == ["heavy0", "light", "other0", "heavy1", "other1"]
    assert [job for job in ran if job.startswith("heavy")] == [f"heavy{i}" for i in range(50)]


def test_a_failing_job_fails_its_future_only() -> None:
    class PanicException(BaseException):
        pass

    def panic() -> None:
        raise PanicException("inside a native library")

    worker = FairWorker("test-fair")
    failed = worker.submit("a", panic)
    with pytest.raises(PanicException):
        failed.result(timeout=10)
    assert worker.submit("a", lambda: 7).result(timeout=10) == 7


def test_a_partition_evicts_only_its_own_entries() -> None:
    cache: PartitionedLru[str, int] = PartitionedLru(4, max_partitions=3)
    cache.put("victim", "schema", 1)
    for i in range(1000):
        cache.put("attacker", f"schema{i}", i)
    assert cache.get("victim", "schema") == 1
    assert cache.num_entries("attacker") == 4
    assert cache.get("attacker", "schema999") == 999 and cache.get("attacker", "schema0") is None


def test_partitions_beyond_the_bound_go_least_recently_used_first() -> None:
    cache: PartitionedLru[str, int] = PartitionedLru(4, max_partitions=2)
    cache.put("a", "k", 1)
    cache.put("b", "k", 2)
    assert cache.get("a", "k") == 1  # a used after b
    cache.put("c", "k", 3)
    assert cache.get("b", "k") is None and cache.get("a", "k") == 1 and len(cache) == 2
