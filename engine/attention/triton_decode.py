# mypy: allow-untyped-defs
# (Triton reads kernel annotations as specialisation hints, so @triton.jit functions stay bare.)
"""Split-KV (FlashDecoding-style) Triton kernels for batches where every sequence decodes one token.

Pass 1 runs one program per (sequence, KV head, partition of the context): it computes softmax
attention of the query heads that share the KV head against its slice of the paged KV, and
writes the partition's normalised output with its running max and sum of exponentials. Pass 2
merges the partitions of each (sequence, query head) by log-sum-exp weighting. Long contexts
therefore spread over many programs even when the batch is small. When a single partition covers
the longest possible context, pass 1 writes the final output and pass 2 is skipped.

Scores live in the log2 domain (`engine.attention.triton_paged_tile`).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.metadata import AttentionMetadata
from engine.attention.triton_paged_tile import (
    LOG2_E,
    load_kv_tile,
    needs_fp32_dot,
    online_softmax_step,
)


@triton.jit
def _decode_partition_kernel(
    query_ptr,  # [B, H, D]: one query row per sequence
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # int32[B, max_blocks_per_seq]
    query_start_loc_ptr,  # int32[B + 1]
    context_lens_ptr,  # int32[B]
    out_ptr,  # [B, H, D]; written here only when WRITE_FINAL
    partial_out_ptr,  # float32[B, H, P, D]: each partition's normalised output
    partial_max_ptr,  # float32[B, H, P]: max score (log2 domain), -inf for an empty partition
    partial_sum_ptr,  # float32[B, H, P]: sum of exp2(score - max), 0 for an empty partition
    scale_log2e,  # softmax scale * log2(e)
    sliding_window,  # keys j with i - j < sliding_window are visible; read when USE_WINDOW
    num_heads,
    num_partitions,
    stride_qt,
    stride_qh,
    stride_cb,
    stride_cs,
    stride_ch,
    stride_bt,
    stride_ot,
    stride_oh,
    QUERY_GROUP: tl.constexpr,  # query heads per KV head (GQA)
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    BLOCK_G: tl.constexpr,  # query heads per program, >= QUERY_GROUP and >= 16 for tl.dot
    BLOCK_D: tl.constexpr,  # >= HEAD_DIM, power of two
    BLOCK_N: tl.constexpr,  # keys per inner tile
    PARTITION_SIZE: tl.constexpr,  # keys per partition, a multiple of BLOCK_N
    USE_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,  # compute dot products in float32 (see needs_fp32_dot)
    WRITE_FINAL: tl.constexpr,  # a single partition: write the output directly
):
    seq = tl.program_id(0)
    kv_head = tl.program_id(1)
    part = tl.program_id(2)
    context_len = tl.load(context_lens_ptr + seq)
    q_row = tl.load(query_start_loc_ptr + seq)

    # The query sits at position context_len - 1; this program covers keys [lo, hi).
    part_start = part * PARTITION_SIZE
    lo = part_start
    if USE_WINDOW:
        lo = tl.maximum(lo, context_len - sliding_window)
    hi = tl.minimum(part_start + PARTITION_SIZE, context_len)

    offs_g = tl.arange(0, BLOCK_G)
    offs_d = tl.arange(0, BLOCK_D)
    g_mask = offs_g < QUERY_GROUP
    d_mask = offs_d < HEAD_DIM
    heads = kv_head * QUERY_GROUP + offs_g
    # q: [BLOCK_G, BLOCK_D]; padding rows are zero and never stored.
    q = tl.load(
        query_ptr + q_row * stride_qt + heads[:, None] * stride_qh + offs_d[None, :],
        mask=g_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    m_i = tl.full([BLOCK_G], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_G], dtype=tl.float32)
    acc = tl.zeros([BLOCK_G, BLOCK_D], dtype=tl.float32)
    # Every tile visited holds at least one visible key, so m_i is finite after the first one.
    tile_lo = lo - (lo - part_start) % BLOCK_N
    for start_n in range(tile_lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = (offs_n >= lo) & (offs_n < hi)
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, offs_n,
                            n_mask, offs_d, d_mask, stride_bt, stride_cb, stride_cs, stride_ch,
                            BLOCK_SIZE, UPCAST)
        m_i, l_i, acc = online_softmax_step(q, k, v, n_mask[None, :], m_i, l_i, acc,
                                            scale_log2e, False)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    store_mask = g_mask[:, None] & d_mask[None, :]
    if WRITE_FINAL:
        tl.store(
            out_ptr + q_row * stride_ot + heads[:, None] * stride_oh + offs_d[None, :],
            out.to(out_ptr.dtype.element_ty),
            mask=store_mask,
        )
    else:
        # Partial results are contiguous [B, H, P, (D)].
        row = (seq * num_heads + heads) * num_partitions + part  # [BLOCK_G]
        tl.store(partial_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :], out, mask=store_mask)
        tl.store(partial_max_ptr + row, m_i, mask=g_mask)
        tl.store(partial_sum_ptr + row, l_i, mask=g_mask)


@triton.jit
def _decode_reduce_kernel(
    query_start_loc_ptr,  # int32[B + 1]
    out_ptr,  # [B, H, D]
    partial_out_ptr,  # float32[B, H, P, D]
    partial_max_ptr,  # float32[B, H, P]
    partial_sum_ptr,  # float32[B, H, P]
    num_heads,
    num_partitions,
    stride_ot,
    stride_oh,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_P: tl.constexpr,  # >= num_partitions, power of two
):
    seq = tl.program_id(0)
    head = tl.program_id(1)
    q_row = tl.load(query_start_loc_ptr + seq)
    offs_p = tl.arange(0, BLOCK_P)
    offs_d = tl.arange(0, BLOCK_D)
    p_mask = offs_p < num_partitions
    d_mask = offs_d < HEAD_DIM
    row = (seq * num_heads + head) * num_partitions + offs_p  # [BLOCK_P]

    m = tl.load(partial_max_ptr + row, mask=p_mask, other=float("-inf"))
    sums = tl.load(partial_sum_ptr + row, mask=p_mask, other=0.0)
    # Log-sum-exp merge: partition p weighs sum_p * exp2(max_p - global max); empty ones weigh 0.
    weights = sums * tl.exp2(m - tl.max(m, 0))
    o = tl.load(
        partial_out_ptr + row[:, None] * HEAD_DIM + offs_d[None, :],
        mask=p_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    out = tl.sum(weights[:, None] * o, 0) / tl.sum(weights, 0)
    tl.store(
        out_ptr + q_row * stride_ot + head * stride_oh + offs_d,
        out.to(out_ptr.dtype.element_ty),
        mask=d_mask,
    )


def paged_decode(
    query: torch.Tensor,  # [B, H, D]: one query row per sequence
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    partition_size: int = 512,
    block_n: int = 64,
) -> torch.Tensor:  # [B, H, D]
    """Attention of one new token per sequence over its paged context, split over partitions.

    The number of partitions comes from the width of the block table (an upper bound of every
    context length), so launching needs no device-to-host copy.
    """
    block_tables, query_start_loc = metadata.block_tables, metadata.query_start_loc
    context_lens = metadata.context_lens
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = context_lens.shape[0]
    block_size, num_kv_heads = k_cache.shape[1], k_cache.shape[2]
    assert num_tokens == num_seqs, "decode expects exactly one query row per sequence"
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert partition_size % block_n == 0, "partition_size must be a multiple of block_n"
    assert query.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    out = torch.empty_like(query)
    if num_seqs == 0:
        return out
    max_context = block_tables.shape[1] * block_size
    num_partitions = max(1, triton.cdiv(max_context, partition_size))
    write_final = num_partitions == 1
    query_group = num_heads // num_kv_heads
    block_d = max(16, triton.next_power_of_2(head_dim))

    partial_shape = (num_seqs, num_heads, 0 if write_final else num_partitions)
    partial_out = torch.empty((*partial_shape, head_dim), dtype=torch.float32, device=query.device)
    partial_max = torch.empty(partial_shape, dtype=torch.float32, device=query.device)
    partial_sum = torch.empty(partial_shape, dtype=torch.float32, device=query.device)

    _decode_partition_kernel[(num_seqs, num_kv_heads, num_partitions)](
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        out,
        partial_out,
        partial_max,
        partial_sum,
        scale * LOG2_E,
        sliding_window or 0,
        num_heads,
        num_partitions,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        QUERY_GROUP=query_group,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=block_size,
        BLOCK_G=max(16, triton.next_power_of_2(query_group)),
        BLOCK_D=block_d,
        BLOCK_N=block_n,
        PARTITION_SIZE=partition_size,
        USE_WINDOW=sliding_window is not None,
        UPCAST=needs_fp32_dot(query.dtype),
        WRITE_FINAL=write_final,
    )
    if not write_final:
        _decode_reduce_kernel[(num_seqs, num_heads)](
            query_start_loc,
            out,
            partial_out,
            partial_max,
            partial_sum,
            num_heads,
            num_partitions,
            out.stride(0),
            out.stride(1),
            HEAD_DIM=head_dim,
            BLOCK_D=block_d,
            BLOCK_P=triton.next_power_of_2(num_partitions),
        )
    return out
