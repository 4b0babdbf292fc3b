from engine.core.kv_cache.block_hash import hash_block
from engine.core.kv_cache.block_pool import BlockPool


def test_uncached_blocks_are_reused_before_cached_ones() -> None:
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    pool.cache(a, hash_block(None, [1, 2], ""))
    pool.free([b, a])
    (first,) = pool.allocate(1)
    assert first.block_hash is None  # an uncached block, the cached one is kept
    assert pool.lookup(hash_block(None, [1, 2], "")) is a


def test_cached_blocks_are_evicted_least_recently_used() -> None:
    pool = BlockPool(3)
    blocks = pool.allocate(3)
    hashes = [hash_block(None, [i], "") for i in range(3)]
    for block, block_hash in zip(blocks, hashes, strict=True):
        pool.cache(block, block_hash)
    pool.free([blocks[1]])
    pool.free([blocks[0]])
    pool.free([blocks[2]])
    (evicted,) = pool.allocate(1)
    assert evicted is blocks[1]
    assert pool.lookup(hashes[1]) is None
    assert pool.lookup(hashes[0]) is blocks[0]


def test_touch_takes_a_cached_block_off_the_free_list() -> None:
    pool = BlockPool(2)
    (block,) = pool.allocate(1)
    pool.cache(block, b"h" * 32)
    pool.free([block])
    assert pool.num_free_blocks == 2
    pool.touch([block])
    assert block.ref_cnt == 1 and pool.num_free_blocks == 1


def test_salt_changes_every_hash() -> None:
    assert hash_block(None, [1, 2, 3], "tenant-a") != hash_block(None, [1, 2, 3], "tenant-b")
    parent = hash_block(None, [1], "")
    assert hash_block(parent, [2], "") != hash_block(None, [2], "")
