"""Prefix-cache keys: a hash chain over full KV blocks.

A block's hash covers its parent's hash, its token ids and the request's extra key (the
tenant's cache salt and the request's adapter, `prefix_key`), so equal hashes mean equal
prefixes of the same tenant on the same weights: a tenant never hits another tenant's cached
blocks unless they share a salt on purpose, and a request never hits blocks another adapter
(or the base model) computed.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

from engine.types import LoraRequest

BlockHash = bytes


def prefix_key(cache_salt: str, lora: LoraRequest | None) -> str:
    """A request's extra key: its tenant's salt, and the adapter its KV depends on."""
    return cache_salt if lora is None else f"{cache_salt}\0adapter:{lora.name}"


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_key: str) -> BlockHash:
    # one update of the concatenation: the same digest as three, sooner (ops/bench/journal.md,
    # "Block crossings, and what inlining or compiling the hot path would give")
    data = (parent or b"\0" * 32) + array("q", token_ids).tobytes() + extra_key.encode()
    return hashlib.sha256(data).digest()


def extend_block_hashes(
    hashes: list[BlockHash], new_token_ids: Sequence[int], block_size: int, extra_key: str
) -> None:
    """Append (in place) the hashes of the full blocks of new_token_ids: the sequence's tokens
    from block len(hashes) on (a request's growth: not its whole sequence again)."""
    parent = hashes[-1] if hashes else None
    for start in range(0, len(new_token_ids) - block_size + 1, block_size):
        parent = hash_block(parent, new_token_ids[start : start + block_size], extra_key)
        hashes.append(parent)
