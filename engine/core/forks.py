"""Parallel samples (n > 1) share their prompt: a later sample forks sample 0's prompt blocks
once they are written, instead of computing the prompt again."""

from __future__ import annotations

from engine.core.kv_cache.kv_manager import KVCacheManager
from engine.core.request import Request, RequestStatus


def try_fork(kv: KVCacheManager, child: Request, num_scheduled_for_parent: int) -> bool | None:
    """Share the prompt blocks of sample 0 with a later sample once they are computed;
    num_scheduled_for_parent: sample 0's tokens scheduled in the step being built.

    True: forked (one token left to compute). False: fall back to a normal prefill.
    None: sample 0 has not finished its prompt yet; wait.
    """
    parent = child.fork_parent
    assert parent is not None
    # The prompt's KV must have been written by an earlier step, not just scheduled.
    num_written = parent.num_computed_tokens - num_scheduled_for_parent
    if parent.status == RequestStatus.RUNNING and num_written >= parent.num_prompt_tokens:
        kv.fork(parent, child, parent.num_prompt_tokens)
        # Recompute the last prompt token in a private copy of its block to get logits.
        child.num_computed_tokens = child.num_prompt_tokens - 1
        return True
    if parent.status in (RequestStatus.WAITING, RequestStatus.RUNNING):
        return None
    child.fork_parent = None
    return False


def undo_fork(kv: KVCacheManager, child: Request) -> None:
    """A fork made for an admission that did not happen gives its blocks back."""
    if child.fork_parent is not None and kv.num_blocks_held(child.request_id):
        kv.free(child)
        child.num_computed_tokens = 0
