"""Prefix-cache keys: a hash chain over full KV blocks.

A block's hash covers its parent's hash, its token ids and the request's extra keys (the
tenant's cache salt), so equal hashes mean equal prefixes of the same tenant: a tenant never
hits another tenant's cached blocks unless they share a salt on purpose.
"""

from __future__ import annotations

import hashlib
from array import array
from collections.abc import Sequence

BlockHash = bytes


def hash_block(parent: BlockHash | None, token_ids: Sequence[int], extra_key: str) -> BlockHash:
    hasher = hashlib.sha256()
    hasher.update(parent or b"\0" * 32)
    hasher.update(array("q", token_ids).tobytes())
    hasher.update(extra_key.encode())
    return hasher.digest()


def extend_block_hashes(
    hashes: list[BlockHash], token_ids: Sequence[int], block_size: int, extra_key: str
) -> None:
    """Append the hashes of every full block of token_ids not yet in hashes (in place)."""
    num_full_blocks = len(token_ids) // block_size
    for index in range(len(hashes), num_full_blocks):
        start = index * block_size
        parent = hashes[-1] if hashes else None
        hashes.append(hash_block(parent, token_ids[start : start + block_size], extra_key))
