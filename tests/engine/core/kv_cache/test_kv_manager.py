from engine import Request, SamplingParams
from engine.core.kv_cache.kv_manager import KVCacheManager


def _request(
    rid: str,
    n_tokens: int,
    priority: int = 1,
    tenant: str = "t",
    salt: str = "",
    cap: int | None = None,
) -> Request:
    return Request(
        rid,
        list(range(3, 3 + n_tokens)),
        SamplingParams(),
        0.0,
        tenant_id=tenant,
        priority=priority,
        cache_salt=salt,
        kv_cap_blocks=cap,
    )


def test_reserved_blocks_go_only_to_their_tier_or_higher() -> None:
    kv = KVCacheManager(10, block_size=4, reserved_blocks={0: 3})
    standard = _request("s", 28)  # 7 blocks: everything not reserved
    assert kv.can_allocate(standard, 28)
    kv.allocate(standard, 28)
    other = _request("s2", 4)
    assert not kv.can_allocate(other, 4), "standard took a premium-reserved block"
    premium = _request("p", 12, priority=0)
    assert kv.can_allocate(premium, 12)


def test_premium_beyond_its_reservation_competes_normally() -> None:
    kv = KVCacheManager(10, block_size=4, reserved_blocks={0: 3})
    premium = _request("p", 20, priority=0)  # 5 blocks, 2 beyond the reservation
    kv.allocate(premium, 20)
    standard = _request("s", 20)
    assert kv.can_allocate(standard, 20)  # 5 left, none of them reserved any more
    assert not kv.can_allocate(_request("s", 24), 24)


def test_tenant_cap_counts_distinct_blocks() -> None:
    kv = KVCacheManager(20, block_size=4)
    first = _request("a", 8, cap=3)
    kv.allocate(first, 8)
    assert kv.exceeds_tenant_cap(_request("b", 8, cap=3), 8)
    assert not kv.exceeds_tenant_cap(_request("c", 4, cap=3), 4)
    assert not kv.exceeds_tenant_cap(_request("d", 8, tenant="other", cap=3), 8)


def test_prefix_hit_leaves_the_last_token_to_compute() -> None:
    kv = KVCacheManager(20, block_size=4)
    writer = _request("w", 8)
    kv.allocate(writer, 8)
    writer.num_computed_tokens = 8  # the step ran: its blocks are written
    kv.cache_full_blocks(writer, writer.num_computed_tokens)
    exact = _request("x", 8)  # same 8 tokens: only the first block may be a hit
    hit = kv.get_computed_blocks(exact)
    assert hit.num_tokens == 4
    longer = _request("y", 9)
    assert kv.get_computed_blocks(longer).num_tokens == 8
    assert kv.get_computed_blocks(longer).blocks == [kv.pool.blocks[i] for i in kv.block_ids("w")]


def test_prefix_cache_is_isolated_by_salt() -> None:
    kv = KVCacheManager(20, block_size=4)
    writer = _request("w", 9, salt="tenant-a")
    kv.allocate(writer, 9)
    writer.num_computed_tokens = 9
    kv.cache_full_blocks(writer, writer.num_computed_tokens)
    assert kv.get_computed_blocks(_request("x", 9, salt="tenant-b")).num_tokens == 0
    assert kv.get_computed_blocks(_request("y", 9, salt="tenant-a")).num_tokens == 8


def test_allocated_but_unwritten_blocks_are_not_cached() -> None:
    kv = KVCacheManager(20, block_size=4)
    kv.allocate(_request("w", 9), 9)  # preempted before its step ran: nothing written
    kv.free(_request("w", 9))
    assert kv.get_computed_blocks(_request("y", 9)).num_tokens == 0


def test_fork_then_write_copies_the_shared_block() -> None:
    kv = KVCacheManager(20, block_size=4)
    parent = _request("p", 6)
    kv.allocate(parent, 6)
    parent.num_computed_tokens = 6
    child = _request("c", 6)
    kv.fork(parent, child, 6)
    assert kv.block_ids("c") == kv.block_ids("p")
    child.num_computed_tokens = 5
    kv.allocate(child, 1)
    copies = kv.take_pending_copies()
    assert copies == [(kv.block_ids("p")[1], kv.block_ids("c")[1])]
    assert kv.block_ids("c")[0] == kv.block_ids("p")[0]  # the full first block stays shared
    kv.free(child)
    kv.free(parent)
    assert kv.num_free_blocks == 20


def test_hashes_of_a_growing_request_equal_those_of_its_whole_sequence() -> None:
    """Decoding, a request's hashes are extended by its new full blocks only: the chain must
    be the one its whole sequence gives at once (a prompt of the same tokens hits them)."""
    kv = KVCacheManager(40, block_size=4)
    grower = _request("g", 6, salt="s")
    kv.allocate(grower, 6)
    grower.num_computed_tokens = 6
    kv.cache_full_blocks(grower, 6)
    for token in range(100, 115):  # outputs one at a time, several blocks filled
        grower.output_token_ids.append(token)
        if not kv.fits_in_place(grower, 1):
            assert kv.grow(grower, 1)
        grower.num_computed_tokens += 1
        kv.cache_full_blocks(grower, grower.num_computed_tokens)
    whole = Request("w", [*grower.all_token_ids, 7], SamplingParams(), 0.0, cache_salt="s")
    hit = kv.get_computed_blocks(whole)
    assert hit.num_tokens == 20  # every full block of the grower's 21 tokens
    assert hit.blocks == [kv.pool.blocks[i] for i in kv.block_ids("g")[:5]]


def test_grow_takes_what_can_allocate_and_allocate_take() -> None:
    """grow is can_allocate and allocate on one plan: the same verdicts under a tier's
    reservation and a tenant's cap, and nothing taken when it says no."""
    for reserved, cap, priority in [({}, None, 1), ({0: 3}, None, 1), ({0: 3}, None, 0),
                                    ({}, 3, 1), ({0: 6}, 4, 1)]:
        one, two = KVCacheManager(10, 4, reserved_blocks=reserved), KVCacheManager(
            10, 4, reserved_blocks=reserved)
        for kv in (one, two):
            kv.allocate(_request("other", 8, tenant="x"), 8)
        a = _request("a", 4, priority=priority, cap=cap)
        b = _request("a", 4, priority=priority, cap=cap)
        one.allocate(a, 4)
        two.allocate(b, 4)
        while True:
            a.num_computed_tokens = b.num_computed_tokens = a.num_computed_tokens + 4
            expected = one.can_allocate(a, 4)
            if expected:
                one.allocate(a, 4)
            assert two.grow(b, 4) is expected
            assert one.block_ids("a") == two.block_ids("a")
            assert one.num_free_blocks == two.num_free_blocks
            if not expected:
                break
