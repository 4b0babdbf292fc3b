"""PartitionedLru: least-recently-used caches, one per partition (tenant), in a bounded number
of partitions.

A tenant's entries are evicted only by its own: one that sends many distinct schemas
cycles its own partition and leaves every other tenant's cached grammars where they are.
Whole partitions go least recently used first once there are more than `max_partitions`.
Not thread-safe: its owner locks.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Hashable
from typing import Generic, TypeVar

__all__ = ["PartitionedLru"]

K = TypeVar("K", bound=Hashable)
V = TypeVar("V")


class PartitionedLru(Generic[K, V]):
    def __init__(self, max_entries_per_partition: int, max_partitions: int) -> None:
        if max_entries_per_partition < 1 or max_partitions < 1:
            raise ValueError("a cache holds at least one entry in one partition")
        self.max_entries_per_partition = max_entries_per_partition
        self.max_partitions = max_partitions
        self._partitions: OrderedDict[str, OrderedDict[K, V]] = OrderedDict()

    def get(self, partition: str, key: K) -> V | None:
        entries = self._partitions.get(partition)
        if entries is None:
            return None
        value = entries.get(key)
        if value is not None:
            entries.move_to_end(key)
            self._partitions.move_to_end(partition)
        return value

    def put(self, partition: str, key: K, value: V) -> None:
        entries = self._partitions.get(partition)
        if entries is None:
            entries = self._partitions[partition] = OrderedDict()
            while len(self._partitions) > self.max_partitions:
                self._partitions.popitem(last=False)
        self._partitions.move_to_end(partition)
        entries[key] = value
        entries.move_to_end(key)
        while len(entries) > self.max_entries_per_partition:
            entries.popitem(last=False)

    def __len__(self) -> int:
        return sum(len(entries) for entries in self._partitions.values())

    def num_entries(self, partition: str) -> int:
        entries = self._partitions.get(partition)
        return 0 if entries is None else len(entries)
