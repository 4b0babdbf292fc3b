# mypy: allow-untyped-defs
# (Triton reads kernel annotations as specialisation hints, so @triton.jit functions stay bare.)
"""Triton kernel for batches with prefill chunks: tiles of queries against paged KV.

Each program takes BLOCK_M consecutive query rows of one sequence and one query head and
streams the sequence's paged K/V in tiles of BLOCK_N keys with an online softmax
(FlashAttention-2 style). The queries of a sequence are its last q_len tokens, so the causal
mask is shifted by the cached prefix: row i of a chunk sits at position context_len - q_len + i.

The launch grid is sized without reading lengths back to the host: sequence b owns the query
tiles starting at global tile index `query_start_loc[b] // BLOCK_M + b`, which bounds the total at
`num_tokens // BLOCK_M + num_seqs`; a program finds its sequence by binary search and exits if
its tile lies past the end of that sequence's queries.
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
def _find_seq(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_M: tl.constexpr):
    """Largest b with query_start_loc[b] // BLOCK_M + b <= tile_idx (the owner of the tile)."""
    lo = 0
    hi = num_seqs
    while lo < hi:
        mid = (lo + hi) // 2
        first_tile = tl.load(query_start_loc_ptr + mid) // BLOCK_M + mid
        if first_tile <= tile_idx:
            lo = mid + 1
        else:
            hi = mid
    return lo - 1


@triton.jit
def _prefill_kernel(
    query_ptr,  # [T, H, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    block_tables_ptr,  # int32[B, max_blocks_per_seq]
    query_start_loc_ptr,  # int32[B + 1]
    context_lens_ptr,  # int32[B]
    out_ptr,  # [T, H, D]
    scale_log2e,  # softmax scale * log2(e)
    sliding_window,  # keys j with i - j < sliding_window are visible; read when USE_WINDOW
    num_seqs,
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
    BLOCK_M: tl.constexpr,  # query rows per program
    BLOCK_N: tl.constexpr,  # keys per inner tile
    BLOCK_D: tl.constexpr,  # >= HEAD_DIM, power of two
    USE_WINDOW: tl.constexpr,
    UPCAST: tl.constexpr,  # compute dot products in float32 (see needs_fp32_dot)
):
    tile_idx = tl.program_id(0)
    head = tl.program_id(1)
    kv_head = head // QUERY_GROUP
    seq = _find_seq(query_start_loc_ptr, tile_idx, num_seqs, BLOCK_M)
    q_start = tl.load(query_start_loc_ptr + seq)
    q_len = tl.load(query_start_loc_ptr + seq + 1) - q_start
    local_tile = tile_idx - (q_start // BLOCK_M + seq)
    if local_tile * BLOCK_M >= q_len:
        return
    context_len = tl.load(context_lens_ptr + seq)
    num_prefix = context_len - q_len  # tokens cached before the first query row

    offs_m = local_tile * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    m_mask = offs_m < q_len
    d_mask = offs_d < HEAD_DIM
    q_pos = num_prefix + offs_m  # [BLOCK_M] absolute positions of the rows
    q = tl.load(
        query_ptr + (q_start + offs_m)[:, None] * stride_qt + head * stride_qh + offs_d[None, :],
        mask=m_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        q = q.to(tl.float32)

    # Keys [lo, hi): causal up to the tile's last row, from the window start of its first row.
    hi = tl.minimum(num_prefix + (local_tile + 1) * BLOCK_M, context_len)
    lo = 0
    if USE_WINDOW:
        lo = tl.maximum(num_prefix + local_tile * BLOCK_M - sliding_window + 1, 0)
        lo = lo - lo % BLOCK_N

    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    for start_n in range(lo, hi, BLOCK_N):
        offs_n = start_n + tl.arange(0, BLOCK_N)
        n_mask = offs_n < hi
        k, v = load_kv_tile(k_cache_ptr, v_cache_ptr, block_tables_ptr, seq, kv_head, offs_n,
                            n_mask, offs_d, d_mask, stride_bt, stride_cb, stride_cs, stride_ch,
                            BLOCK_SIZE, UPCAST)
        visible = n_mask[None, :] & (offs_n[None, :] <= q_pos[:, None])
        if USE_WINDOW:
            visible = visible & (offs_n[None, :] > q_pos[:, None] - sliding_window)
        m_i, l_i, acc = online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2e,
                                            True)

    out = acc / tl.where(l_i > 0.0, l_i, 1.0)[:, None]
    tl.store(
        out_ptr + (q_start + offs_m)[:, None] * stride_ot + head * stride_oh + offs_d[None, :],
        out.to(out_ptr.dtype.element_ty),
        mask=m_mask[:, None] & d_mask[None, :],
    )


def paged_prefill(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    block_m: int = 64,
    block_n: int = 64,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each sequence's query rows over its paged context (prefix + chunk)."""
    block_tables, query_start_loc = metadata.block_tables, metadata.query_start_loc
    context_lens = metadata.context_lens
    num_tokens, num_heads, head_dim = query.shape
    num_seqs = context_lens.shape[0]
    num_kv_heads = k_cache.shape[2]
    assert num_heads % num_kv_heads == 0, "query heads must be a multiple of KV heads"
    assert query.stride(2) == 1 and k_cache.stride(3) == 1 and k_cache.stride() == v_cache.stride()
    out = torch.empty_like(query)
    if num_tokens == 0 or num_seqs == 0:
        return out
    num_tiles = num_tokens // block_m + num_seqs
    _prefill_kernel[(num_tiles, num_heads)](
        query,
        k_cache,
        v_cache,
        block_tables,
        query_start_loc,
        context_lens,
        out,
        scale * LOG2_E,
        sliding_window or 0,
        num_seqs,
        query.stride(0),
        query.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        block_tables.stride(0),
        out.stride(0),
        out.stride(1),
        QUERY_GROUP=num_heads // num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_M=block_m,
        BLOCK_N=block_n,
        BLOCK_D=max(16, triton.next_power_of_2(head_dim)),
        USE_WINDOW=sliding_window is not None,
        UPCAST=needs_fp32_dot(query.dtype),
    )
    return out
