# mypy: allow-untyped-defs
# (Triton reads kernel annotations as specialisation hints, so @triton.jit functions stay bare.)
"""What the Triton attention kernels share: one tile of a sequence's paged K/V read through
its block table, and the online-softmax update of a block of query rows with that tile
(FlashAttention-2 style, scores in the log2 domain: `exp2`, log2(e) folded into the scale).

Helpers are inlined into the kernels that call them.
"""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

# Scale factor between natural and base-2 exponentials.
LOG2_E = 1.4426950408889634


def is_interpreting() -> bool:
    """True when Triton runs kernels on the CPU through its interpreter (TRITON_INTERPRET=1)."""
    return os.environ.get("TRITON_INTERPRET", "0") == "1"


def needs_fp32_dot(dtype: torch.dtype) -> bool:
    """The interpreter computes with numpy, which has no bfloat16: tl.dot on bf16 gives garbage.

    Kernels then upcast bf16 tiles to float32 before their dot products. On a GPU, bf16 and fp16
    tiles go to the tensor cores as they are, accumulating in float32.
    """
    return is_interpreting() and dtype == torch.bfloat16


@triton.jit
def load_kv_tile(
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,
    block_tables_ptr,  # int32[B, max_blocks_per_seq]
    seq,
    kv_head,
    offs_n,  # [BLOCK_N] key positions of the tile
    n_mask,  # [BLOCK_N] which of them to read
    offs_d,  # [BLOCK_D]
    d_mask,
    stride_bt,
    stride_cb,
    stride_cs,
    stride_ch,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    UPCAST: tl.constexpr,  # float32 tiles (see needs_fp32_dot)
):
    """k: [BLOCK_D, BLOCK_N] (transposed for the dot), v: [BLOCK_N, BLOCK_D]; masked keys 0."""
    block_ids = tl.load(
        block_tables_ptr + seq * stride_bt + offs_n // BLOCK_SIZE, mask=n_mask, other=0
    ).to(tl.int64)
    kv_offs = block_ids * stride_cb + (offs_n % BLOCK_SIZE) * stride_cs + kv_head * stride_ch
    k = tl.load(
        k_cache_ptr + kv_offs[None, :] + offs_d[:, None],
        mask=n_mask[None, :] & d_mask[:, None],
        other=0.0,
    )
    v = tl.load(
        v_cache_ptr + kv_offs[:, None] + offs_d[None, :],
        mask=n_mask[:, None] & d_mask[None, :],
        other=0.0,
    )
    if UPCAST:
        k = k.to(tl.float32)
        v = v.to(tl.float32)
    return k, v


@triton.jit
def online_softmax_step(q, k, v, visible, m_i, l_i, acc, scale_log2e,
                        ROWS_MAY_SEE_NOTHING: tl.constexpr):
    """Fold one K/V tile into rows' running max m_i, sum of exponentials l_i and unnormalised
    output acc; visible: which (row, key) scores count. ROWS_MAY_SEE_NOTHING: a row may see no
    key of the tile (a window, a padding row) and must keep a finite max; the decode kernel
    visits only tiles with a visible key and skips that guard."""
    # k and v in the cache's dtype, converted to q's where they differ (an fp8 cache).
    s = tl.dot(q, k.to(q.dtype), input_precision="ieee") * scale_log2e  # [rows, BLOCK_N]
    s = tl.where(visible, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = m_new
    if ROWS_MAY_SEE_NOTHING:
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    l_i = l_i * alpha + tl.sum(p, 1)
    acc = acc * alpha[:, None] + tl.dot(p.to(q.dtype), v.to(q.dtype), input_precision="ieee")
    return m_new, l_i, acc
