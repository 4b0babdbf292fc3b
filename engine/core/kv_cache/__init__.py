"""The paged KV cache's bookkeeping: block hashes for the prefix cache, the block pool
(reference counts, free lists), and per-request block tables with tier reservations and
tenant caps (`KVCacheManager`). Imports only the neutral modules.
"""

from engine.core.kv_cache.block_hash import hash_block
from engine.core.kv_cache.block_pool import BlockPool
from engine.core.kv_cache.kv_manager import ComputedBlocks, KVCacheManager, tier_allowance

__all__ = [
    "BlockPool",
    "ComputedBlocks",
    "KVCacheManager",
    "hash_block",
    "tier_allowance",
]
