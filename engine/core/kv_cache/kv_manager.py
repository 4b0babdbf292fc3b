"""Per-request KV block tables over the block pool, with tier reservations and tenant caps.

Reservation rule: blocks reserved for a tier go only to that tier or a higher one. For a
request of priority q (lower is more important) the manager keeps, for every more important
tier T, max(used(T), reserved(T)) blocks out of reach, so lower tiers together never hold
blocks that a higher tier has reserved and not used.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Hashable, Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Generic, TypeVar

from engine.core.kv_cache.block_hash import BlockHash, extend_block_hashes
from engine.core.kv_cache.block_pool import BlockPool, KVBlock
from engine.core.request import Request

K = TypeVar("K", bound=Hashable)


class _DistinctHolders(Generic[K]):
    """Counts, per key (a tier or a tenant), the distinct blocks that key's requests hold."""

    def __init__(self) -> None:
        self._refs: dict[int, dict[K, int]] = defaultdict(dict)  # block id -> key -> refs
        self.num_blocks: dict[K, int] = defaultdict(int)  # key -> distinct blocks held

    def take(self, key: K, block: KVBlock) -> None:
        refs = self._refs[block.block_id]
        count = refs.get(key, 0) + 1
        refs[key] = count
        if count == 1:
            self.num_blocks[key] += 1

    def drop(self, key: K, block: KVBlock) -> None:
        refs = self._refs[block.block_id]
        refs[key] -= 1
        if refs[key] == 0:
            del refs[key]
            self.num_blocks[key] -= 1
            if not refs:
                del self._refs[block.block_id]

    def holds(self, key: K, block: KVBlock) -> bool:
        return key in self._refs.get(block.block_id, {})


def tier_allowance(
    num_blocks: int,
    used_by_priority: Mapping[int, int],
    reserved_by_priority: Mapping[int, int],
    priority: int,
    count_lower_tiers_as_free: bool = False,
) -> int:
    """Blocks of a pool of num_blocks a request of this priority may still take under the
    reservation rule; count_lower_tiers_as_free: what less important tiers hold counts as
    free (it may preempt them)."""
    # Asked at every block a request grows by: no sets built.
    used_or_reserved = 0
    for prio, used in used_by_priority.items():
        if prio < priority:
            used_or_reserved += max(used, reserved_by_priority.get(prio, 0))
        elif prio == priority or not count_lower_tiers_as_free:
            used_or_reserved += used
    for prio, reserved in reserved_by_priority.items():
        if prio < priority and prio not in used_by_priority:
            used_or_reserved += reserved
    return num_blocks - used_or_reserved


@dataclass
class ComputedBlocks:
    """A prefix-cache hit for a request not yet holding blocks."""

    blocks: list[KVBlock] = field(default_factory=list)  # cached blocks, in prefix order
    num_tokens: int = 0  # tokens they cover (a multiple of block_size)


@dataclass
class _Allocation:
    """What admitting num_new_tokens would take (computed by _plan)."""

    num_new_blocks: int  # fresh blocks to take from the pool, COW copy included
    num_from_free: int  # pool free blocks consumed (fresh + evictable cache hits)
    num_new_tier_blocks: int  # growth of the tier's distinct blocks
    num_new_tenant_blocks: int  # growth of the tenant's distinct blocks
    cow_index: int | None  # block table index that must be copied before writing


class KVCacheManager:
    def __init__(
        self,
        num_blocks: int,
        block_size: int = 16,
        enable_prefix_caching: bool = True,
        reserved_blocks: dict[int, int] | None = None,
    ) -> None:
        self.block_size = block_size
        self.pool = BlockPool(num_blocks, enable_prefix_caching)
        # priority -> blocks reserved for that tier (and usable by higher tiers)
        self.reserved_blocks = dict(reserved_blocks or {})
        assert sum(self.reserved_blocks.values()) <= num_blocks, "reservations exceed the pool"
        self._tables: dict[str, list[KVBlock]] = {}
        self._hashes: dict[str, list[BlockHash]] = {}
        self._num_cached: dict[str, int] = {}  # request id -> leading table blocks already cached
        self._owners: dict[str, tuple[int, str]] = {}  # request id -> (priority, tenant id)
        self._tiers: _DistinctHolders[int] = _DistinctHolders()
        self._tenants: _DistinctHolders[str] = _DistinctHolders()
        # Copy-on-write pairs produced by allocate(), drained by the scheduler each step.
        self._pending_copies: list[tuple[int, int]] = []
        # request id -> first block table index changed since take_changed_tables (the
        # scheduler tells the runner only what changed)
        self._changed_from: dict[str, int] = {}

    # -- read-only views -------------------------------------------------------------------

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def num_free_blocks(self) -> int:
        return self.pool.num_free_blocks

    @property
    def num_used_blocks(self) -> int:
        return self.pool.num_blocks - self.pool.num_free_blocks

    def block_ids(self, request_id: str, start: int = 0) -> list[int]:
        """The request's block table from index start on."""
        return [b.block_id for b in self._tables.get(request_id, [])[start:]]

    def num_blocks_held(self, request_id: str) -> int:
        return len(self._tables.get(request_id, []))

    def num_tier_blocks(self, priority: int) -> int:
        return self._tiers.num_blocks[priority]

    def num_exclusive_blocks(self, request_id: str) -> int:
        """Blocks that would return to the pool if this request were freed now."""
        return sum(1 for b in self._tables.get(request_id, []) if b.ref_cnt == 1)

    def tier_allowance(self, priority: int) -> int:
        """Blocks a request of this priority may still take without touching others' floors."""
        return tier_allowance(
            self.num_blocks, self._tiers.num_blocks, self.reserved_blocks, priority
        )

    # -- prefix cache ------------------------------------------------------------------------

    def get_computed_blocks(self, request: Request) -> ComputedBlocks:
        """Longest cached prefix of full blocks, leaving at least one token to compute."""
        if not self.pool.enable_prefix_caching:
            return ComputedBlocks()
        hashes = self._request_hashes(request)
        max_blocks = (request.num_tokens - 1) // self.block_size
        hit = ComputedBlocks()
        for block_hash in hashes[:max_blocks]:
            block = self.pool.lookup(block_hash)
            if block is None:
                break
            hit.blocks.append(block)
        hit.num_tokens = len(hit.blocks) * self.block_size
        return hit

    def _request_hashes(self, request: Request) -> list[BlockHash]:
        hashes = self._hashes.setdefault(request.request_id, [])
        block_size = self.block_size
        num_full = request.num_tokens // block_size
        if len(hashes) < num_full:  # the new full blocks' tokens only (a decode: one block)
            new_tokens = request.token_ids(len(hashes) * block_size, num_full * block_size)
            extend_block_hashes(hashes, new_tokens, block_size, request.cache_salt)
        return hashes

    # -- allocation --------------------------------------------------------------------------

    def _plan(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None
    ) -> _Allocation:
        table = self._tables.get(request.request_id, [])
        hit_blocks = computed.blocks if computed else []
        num_hit_tokens = computed.num_tokens if computed else 0
        num_tokens_after = request.num_computed_tokens + num_hit_tokens + num_new_tokens
        num_required = -(-num_tokens_after // self.block_size)
        num_fresh = max(0, num_required - len(table) - len(hit_blocks))
        # Copy-on-write: the first block written to is shared with another request.
        write_index = (request.num_computed_tokens + num_hit_tokens) // self.block_size
        cow_index = None
        if num_new_tokens > 0 and write_index < len(table) and table[write_index].ref_cnt > 1:
            cow_index = write_index
        num_new_blocks = num_fresh + (1 if cow_index is not None else 0)
        num_evictable_hits = new_tier = new_tenant = 0
        if hit_blocks:  # an admission's prefix hit (a growth has none)
            num_evictable_hits = sum(1 for b in hit_blocks if b.ref_cnt == 0)
            priority, tenant = request.priority, request.tenant_id
            new_tier = sum(1 for b in hit_blocks if not self._tiers.holds(priority, b))
            new_tenant = sum(1 for b in hit_blocks if not self._tenants.holds(tenant, b))
        return _Allocation(
            num_new_blocks=num_new_blocks,
            num_from_free=num_new_blocks + num_evictable_hits,
            num_new_tier_blocks=num_new_blocks + new_tier,
            num_new_tenant_blocks=num_new_blocks + new_tenant,
            cow_index=cow_index,
        )

    def fits_in_place(self, request: Request, num_new_tokens: int) -> bool:
        """Whether the request's blocks already have room for num_new_tokens more tokens and
        the first block written is its own: nothing to allocate or copy (most decode steps)."""
        table = self._tables.get(request.request_id)
        if not table:
            return False
        start = request.num_computed_tokens
        if start + num_new_tokens > len(table) * self.block_size:
            return False
        return table[start // self.block_size].ref_cnt == 1

    def exceeds_tenant_cap(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> bool:
        if request.kv_cap_blocks is None:
            return False
        return self._over_tenant_cap(request, self._plan(request, num_new_tokens, computed))

    def _over_tenant_cap(self, request: Request, plan: _Allocation) -> bool:
        if request.kv_cap_blocks is None:
            return False
        held = self._tenants.num_blocks[request.tenant_id]
        return held + plan.num_new_tenant_blocks > request.kv_cap_blocks

    def room_makers(
        self, request: Request, num_new_tokens: int, running: Sequence[Request]
    ) -> list[Request]:
        """The running requests whose blocks could make room for request to grow: over its
        tenant's KV cap, only the tenant's own."""
        if self.exceeds_tenant_cap(request, num_new_tokens):
            return [r for r in running if r.tenant_id == request.tenant_id]
        return list(running)

    def can_allocate(
        self,
        request: Request,
        num_new_tokens: int,
        computed: ComputedBlocks | None = None,
        num_blocks_to_be_freed: int = 0,
    ) -> bool:
        """Whether slots for num_new_tokens more tokens can be had now.

        num_blocks_to_be_freed: blocks of lower tiers the caller is about to preempt (they
        count as free both in the pool and in this tier's allowance).
        """
        plan = self._plan(request, num_new_tokens, computed)
        return self._fits(request, plan, num_blocks_to_be_freed)

    def _fits(self, request: Request, plan: _Allocation, num_blocks_to_be_freed: int = 0) -> bool:
        if plan.num_from_free > self.pool.num_free_blocks + num_blocks_to_be_freed:
            return False
        allowance = self.tier_allowance(request.priority) + num_blocks_to_be_freed
        if plan.num_new_tier_blocks > allowance:
            return False
        return not self._over_tenant_cap(request, plan)

    def grow(self, request: Request, num_new_tokens: int) -> bool:
        """Take the slots for num_new_tokens more tokens of a request holding blocks, if they
        can be had now (can_allocate and allocate on one plan: a running request asks at
        every block it fills); False: nothing was taken."""
        plan = self._plan(request, num_new_tokens, None)
        if not self._fits(request, plan):
            return False
        self._allocate(request, plan, None)
        return True

    def allocate(
        self, request: Request, num_new_tokens: int, computed: ComputedBlocks | None = None
    ) -> None:
        """Take the slots can_allocate agreed to, adopting the prefix hit."""
        self._allocate(request, self._plan(request, num_new_tokens, computed), computed)

    def _allocate(
        self, request: Request, plan: _Allocation, computed: ComputedBlocks | None
    ) -> None:
        # The caller checked (can_allocate, or grow on this plan): checking again would cost
        # allocate() a third plan.
        assert plan.num_from_free <= self.pool.num_free_blocks, "allocate without room"
        request_id = request.request_id
        table = self._tables.setdefault(request_id, [])
        owner = (request.priority, request.tenant_id)
        self._owners[request_id] = owner
        if computed and computed.blocks:
            assert not table, "prefix hits are adopted only by requests holding no blocks"
            self.pool.touch(computed.blocks)
            self._take(owner, computed.blocks)
            table.extend(computed.blocks)
            self._changed_from[request_id] = 0
            request.num_computed_tokens = computed.num_tokens
        fresh = self.pool.allocate(plan.num_new_blocks)
        self._take(owner, fresh)
        if fresh:
            first = len(table) if plan.cow_index is None else plan.cow_index
            self._changed_from[request_id] = min(self._changed_from.get(request_id, first), first)
        if plan.cow_index is not None:
            shared, copy = table[plan.cow_index], fresh.pop()
            self._pending_copies.append((shared.block_id, copy.block_id))
            table[plan.cow_index] = copy
            self._release(owner, [shared])
            self._num_cached[request_id] = min(self._num_cached.get(request_id, 0), plan.cow_index)
        table.extend(fresh)

    def cache_full_blocks(self, request: Request, num_tokens_written: int) -> None:
        """Enter the request's full blocks among its first num_tokens_written tokens in the
        prefix cache.

        Called after the step that wrote them ran, never at allocation: a request preempted
        in the step that allocated its blocks never wrote them, and must not leave them in
        the cache (nor may a step still in flight, which could fail).
        """
        if not self.pool.enable_prefix_caching or request.request_id not in self._tables:
            return
        hashes = self._request_hashes(request)
        table = self._tables[request.request_id]
        num_full = min(num_tokens_written // self.block_size, len(hashes), len(table))
        for index in range(self._num_cached.get(request.request_id, 0), num_full):
            self.pool.cache(table[index], hashes[index])
        self._num_cached[request.request_id] = max(num_full, 0)

    def fork(self, parent: Request, child: Request, num_tokens: int) -> None:
        """Share the parent's blocks covering num_tokens tokens with a new sample (refs +1)."""
        assert child.request_id not in self._tables
        num_shared = -(-num_tokens // self.block_size)
        shared = self._tables[parent.request_id][:num_shared]
        owner = (child.priority, child.tenant_id)
        self.pool.touch(shared)
        self._take(owner, shared)
        self._tables[child.request_id] = list(shared)
        self._changed_from[child.request_id] = 0
        self._owners[child.request_id] = owner

    def free(self, request: Request) -> None:
        """Release every block of the request (finish, abort or preemption)."""
        table = self._tables.pop(request.request_id, None)
        owner = self._owners.pop(request.request_id, None)
        self._num_cached.pop(request.request_id, None)
        self._changed_from.pop(request.request_id, None)
        if table is None or owner is None:
            return
        self._release(owner, reversed(table))

    def forget(self, request: Request) -> None:
        """Drop the request's hash cache once it is finished for good."""
        self._hashes.pop(request.request_id, None)

    def take_pending_copies(self) -> list[tuple[int, int]]:
        copies, self._pending_copies = self._pending_copies, []
        return copies

    def take_changed_tables(self) -> dict[str, int]:
        """The block tables changed since the previous call: request id -> first changed
        index (block_ids(request_id, index) reads them). Tables grow at the end, and
        copy-on-write replaces one entry; a prefix hit or a fork makes a new table."""
        changed, self._changed_from = self._changed_from, {}
        return changed

    def _take(self, owner: tuple[int, str], blocks: Sequence[KVBlock]) -> None:
        priority, tenant = owner
        for block in blocks:
            self._tiers.take(priority, block)
            self._tenants.take(tenant, block)

    def _release(self, owner: tuple[int, str], blocks: Iterable[KVBlock]) -> None:
        priority, tenant = owner
        released = list(blocks)
        for block in released:
            self._tiers.drop(priority, block)
            self._tenants.drop(tenant, block)
        self.pool.free(released)
