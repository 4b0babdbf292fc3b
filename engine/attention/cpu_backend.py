"""Paged attention on the CPU: the C++ kernel for decode rows, the torch reference for the rest.

Decodes are memory-bound: the kernel (engine.attention.cpu_kernel) reads each sequence's K/V
blocks in place, where the reference copies them out first. Prefill chunks are compute-bound
and SDPA's tiled matrix products beat the kernel's row-at-a-time loop, so sequences with more
than KERNEL_MAX_ROWS query rows stay on the reference. Without the kernel (no compiler), for
dtypes other than float32 or head sizes the kernel does not take, everything runs on the
reference.
"""

from __future__ import annotations

import torch

from engine.attention import cpu_kernel, reference
from engine.attention.reference import AttentionPlan, write_kv

__all__ = ["KERNEL_MAX_ROWS", "paged_attention", "paged_attention_planned", "plan", "write_kv"]

# Sequences with at most this many query rows go to the kernel.
KERNEL_MAX_ROWS = 1


def plan(
    block_tables: torch.Tensor,  # int32[B, max_blocks_per_seq]
    query_start_loc: torch.Tensor,  # int32[B + 1]
    context_lens: torch.Tensor,  # int32[B]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D] of any layer
) -> AttentionPlan:
    """The reference's plan, with the kernel's sequences set apart when the kernel applies."""
    uses_kernel = (
        k_cache.dtype == torch.float32
        and cpu_kernel.supports_head_dim(k_cache.shape[3])
        and cpu_kernel.load() is not None
    )
    return reference.plan_attention(
        block_tables, query_start_loc, context_lens, k_cache,
        kernel_max_rows=KERNEL_MAX_ROWS if uses_kernel else 0,
    )


def paged_attention_planned(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # int32[B, max_blocks_per_seq], the plan's batch
    query_start_loc: torch.Tensor,  # int32[B + 1]
    context_lens: torch.Tensor,  # int32[B]
    attention_plan: AttentionPlan,
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, H, D]
    """paged_attention over a plan made by `plan` for the same batch."""
    out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
    if attention_plan.kernel_seq_ids is not None:
        cpu_kernel.paged_attention(
            query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
            sliding_window, seq_ids=attention_plan.kernel_seq_ids, out=out,
        )
    return reference.paged_attention_planned(
        query, k_cache, v_cache, attention_plan, scale, sliding_window, out
    )


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # int32[B, max_blocks_per_seq]
    query_start_loc: torch.Tensor,  # int32[B + 1]
    context_lens: torch.Tensor,  # int32[B]
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each sequence's last q_len tokens over its cached context."""
    layout = (block_tables, query_start_loc, context_lens)
    return paged_attention_planned(
        query, k_cache, v_cache, *layout, plan(*layout, k_cache), scale, sliding_window
    )
