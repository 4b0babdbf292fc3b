"""Paged attention on CUDA through Triton, behind the same two functions as the torch reference.

`paged_attention` sends decode-only batches (one query row per sequence) to the split-KV decode
kernels and everything else (prefill chunks, possibly mixed with decodes) to the prefill kernel.
Both kernels implement sliding windows, so no call falls back to the reference.

Inputs must live on a CUDA device, or on the CPU with TRITON_INTERPRET=1 set before Triton was
imported (the interpreter is what the CPU test suite uses; it is far too slow to serve with).
Every sequence must contribute at least one query row, and every context_len must be >= its
query count: the dispatch tells decode from prefill by `num_tokens == num_seqs` without
reading lengths back from the device.
"""

from __future__ import annotations

import torch

from engine.attention import triton_kv_write
from engine.attention.triton_decode import is_interpreting, paged_decode
from engine.attention.triton_prefill import paged_prefill

__all__ = ["paged_attention", "write_kv"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Tile sizes for GPUs. The interpreter (CPU tests) runs each program in Python, where large
# tiles cost little and fewer programs save a lot; the tests pass their own small sizes.
DECODE_PARTITION_SIZE = 512  # keys per decode partition
DECODE_BLOCK_N = 64  # keys per decode inner tile
PREFILL_BLOCK_M = 64  # query rows per prefill program
PREFILL_BLOCK_N = 64  # keys per prefill inner tile


def _check_inputs(query: torch.Tensor, k_cache: torch.Tensor) -> None:
    if not (query.is_cuda or is_interpreting()):
        raise RuntimeError(
            "the Triton attention backend needs CUDA tensors (or TRITON_INTERPRET=1 for tests); "
            "use engine.attention.reference on the CPU"
        )
    if query.dtype not in SUPPORTED_DTYPES or k_cache.dtype != query.dtype:
        raise TypeError(f"unsupported dtypes: query {query.dtype}, cache {k_cache.dtype}")


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # int64[T]; -1 skips the token
) -> None:
    """Write each token's K and V into its cache slot (block_id * block_size + offset), in place."""
    _check_inputs(key, k_cache)
    triton_kv_write.write_kv(key, value, k_cache, v_cache, slot_mapping)


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
    _check_inputs(query, k_cache)
    num_seqs = context_lens.shape[0]
    if query.shape[0] == num_seqs:
        return paged_decode(
            query,
            k_cache,
            v_cache,
            block_tables,
            query_start_loc,
            context_lens,
            scale,
            sliding_window,
            partition_size=DECODE_PARTITION_SIZE,
            block_n=DECODE_BLOCK_N,
        )
    return paged_prefill(
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        scale,
        sliding_window,
        block_m=PREFILL_BLOCK_M,
        block_n=PREFILL_BLOCK_N,
    )
