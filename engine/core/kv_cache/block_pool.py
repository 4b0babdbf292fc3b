"""The KV block pool: reference counts, free lists and the prefix-cache map.

Only this module touches the free lists. Free blocks come in two kinds: uncached ones (reused
first) and cached ones (holding a full block's KV under a hash, kept for prefix hits and
evicted least-recently-used when nothing else is free).
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterable
from dataclasses import dataclass

from engine.core.kv_cache.block_hash import BlockHash


@dataclass(eq=False)
class KVBlock:
    block_id: int
    ref_cnt: int = 0  # requests holding this block
    block_hash: BlockHash | None = None  # set once the block is full and cached


class BlockPool:
    def __init__(self, num_blocks: int, enable_prefix_caching: bool = True) -> None:
        assert num_blocks > 0
        self.num_blocks = num_blocks
        self.enable_prefix_caching = enable_prefix_caching
        self.blocks = [KVBlock(i) for i in range(num_blocks)]
        # Uncached free blocks, reused first (a dict as an ordered set).
        self._free_uncached: dict[int, KVBlock] = {b.block_id: b for b in self.blocks}
        # Cached free blocks in LRU order: oldest first, evicted first.
        self._free_cached: OrderedDict[int, KVBlock] = OrderedDict()
        self._cached: dict[BlockHash, KVBlock] = {}
        self.num_prefix_queries = 0  # blocks looked up
        self.num_prefix_hits = 0  # blocks found

    @property
    def num_free_blocks(self) -> int:
        """Blocks that can be handed out now (uncached free + evictable cached)."""
        return len(self._free_uncached) + len(self._free_cached)

    @property
    def num_cached_blocks(self) -> int:
        return len(self._cached)

    def can_allocate(self, num_blocks: int) -> bool:
        return num_blocks <= self.num_free_blocks

    def allocate(self, num_blocks: int) -> list[KVBlock]:
        """Take num_blocks free blocks (uncached first, then evict LRU cached), ref_cnt 1."""
        assert self.can_allocate(num_blocks), "allocate without can_allocate"
        taken: list[KVBlock] = []
        for _ in range(num_blocks):
            if self._free_uncached:
                _, block = self._free_uncached.popitem()
            else:
                _, block = self._free_cached.popitem(last=False)
                self._evict(block)
            block.ref_cnt = 1
            taken.append(block)
        return taken

    def _evict(self, block: KVBlock) -> None:
        assert block.block_hash is not None
        if self._cached.get(block.block_hash) is block:
            del self._cached[block.block_hash]
        block.block_hash = None

    def lookup(self, block_hash: BlockHash) -> KVBlock | None:
        """The cached block holding this hash, if any (counts toward the hit ratio)."""
        self.num_prefix_queries += 1
        block = self._cached.get(block_hash)
        if block is not None:
            self.num_prefix_hits += 1
        return block

    def touch(self, blocks: Iterable[KVBlock]) -> None:
        """Take one more reference on each block (prefix hit or fork)."""
        for block in blocks:
            if block.ref_cnt == 0:
                self._free_cached.pop(block.block_id, None)
                self._free_uncached.pop(block.block_id, None)
            block.ref_cnt += 1

    def cache(self, block: KVBlock, block_hash: BlockHash) -> None:
        """Record a full block under its hash; a hash already cached keeps its first block."""
        if not self.enable_prefix_caching or block.block_hash is not None:
            return
        if block_hash in self._cached:
            return
        block.block_hash = block_hash
        self._cached[block_hash] = block

    def free(self, blocks: Iterable[KVBlock]) -> None:
        """Drop one reference per block; blocks reaching zero go to a free list.

        Callers pass a request's blocks tail first so that, under eviction, the ends of
        cached prefixes go before their beginnings.
        """
        for block in blocks:
            assert block.ref_cnt > 0, f"block {block.block_id} freed more often than taken"
            block.ref_cnt -= 1
            if block.ref_cnt == 0:
                if block.block_hash is not None:
                    self._free_cached[block.block_id] = block
                else:
                    self._free_uncached[block.block_id] = block
