# mypy: allow-untyped-defs
# (Triton reads kernel annotations as specialisation hints, so @triton.jit functions stay bare.)
"""Triton kernel that scatters new K/V rows into the paged KV cache.

The cache of one layer is two tensors `[num_blocks, block_size, num_kv_heads, head_dim]`. Token t
goes to `slot_mapping[t] = block_id * block_size + offset`; slot -1 marks a padding token that is
not written (CUDA-graph padding, or a token whose KV must not land in the cache). An fp8 cache
(float8 E4M3, `--kv-cache-dtype fp8`) takes the rows as they are, scale 1 as vLLM's default,
saturated at E4M3's largest finite value (448) rather than overflowing to NaN, rounded to the
nearest E4M3 value (ties to even) in float32 before the conversion, which then only changes
the type: the same rounding on every GPU and under the interpreter, whose own conversion
rounds some values into the wrong binade.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

FP8_MAX: tl.constexpr = tl.constexpr(448.0)  # float8 E4M3's largest finite value
FP8_MIN_NORMAL: tl.constexpr = tl.constexpr(2.0**-6)
# Added and taken away, rounds |x| < 2^-6 to a multiple of 2^-9 (E4M3's subnormal step): its
# float32 spacing is 2^-9.
FP8_SUBNORMAL_ROUNDER: tl.constexpr = tl.constexpr(1.5 * 2.0**14)


@triton.jit
def round_to_e4m3(x):
    """x (float32) saturated to +-448 and rounded to the nearest float8 E4M3 value, ties to
    even, still float32."""
    x = tl.clamp(x, -FP8_MAX, FP8_MAX)
    bits = x.to(tl.int32, bitcast=True)
    # Three mantissa bits of float32's 23 kept: add half of the dropped 20 bits' range (less
    # one unless the kept part is odd), then clear them; a carry moves the exponent up.
    kept = (bits + 0x7FFFF + ((bits >> 20) & 1)) & -1048576
    normal = kept.to(tl.float32, bitcast=True)
    subnormal = (x + FP8_SUBNORMAL_ROUNDER) - FP8_SUBNORMAL_ROUNDER
    return tl.where(tl.abs(x) < FP8_MIN_NORMAL, subnormal, normal)


@triton.jit
def _write_kv_kernel(
    key_ptr,  # [T, Hkv, D]
    value_ptr,  # [T, Hkv, D]
    k_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    v_cache_ptr,  # [num_blocks, block_size, Hkv, D]
    slot_mapping_ptr,  # int64[T]
    stride_kt,
    stride_kh,
    stride_vt,
    stride_vh,
    stride_cb,  # cache strides (k and v caches share their layout)
    stride_cs,
    stride_ch,
    NUM_KV_HEADS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_SIZE: tl.constexpr,  # tokens per KV block
    BLOCK_H: tl.constexpr,  # next power of two >= NUM_KV_HEADS
    BLOCK_D: tl.constexpr,  # next power of two >= HEAD_DIM
    TO_FP8: tl.constexpr,  # the cache is fp8: saturate and round in float32 first
):
    token = tl.program_id(0)
    slot = tl.load(slot_mapping_ptr + token)
    if slot < 0:
        return
    block_id = slot // BLOCK_SIZE
    offset = slot % BLOCK_SIZE

    offs_h = tl.arange(0, BLOCK_H)
    offs_d = tl.arange(0, BLOCK_D)
    mask = (offs_h[:, None] < NUM_KV_HEADS) & (offs_d[None, :] < HEAD_DIM)
    # One program moves the whole [Hkv, D] row of its token, for K and for V.
    key = tl.load(
        key_ptr + token * stride_kt + offs_h[:, None] * stride_kh + offs_d[None, :], mask=mask
    )
    value = tl.load(
        value_ptr + token * stride_vt + offs_h[:, None] * stride_vh + offs_d[None, :], mask=mask
    )
    if TO_FP8:
        key = round_to_e4m3(key.to(tl.float32))
        value = round_to_e4m3(value.to(tl.float32))
    cache_offs = (
        block_id * stride_cb + offset * stride_cs + offs_h[:, None] * stride_ch + offs_d[None, :]
    )
    tl.store(k_cache_ptr + cache_offs, key.to(k_cache_ptr.dtype.element_ty), mask=mask)
    tl.store(v_cache_ptr + cache_offs, value.to(v_cache_ptr.dtype.element_ty), mask=mask)


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # int64[T]; -1 skips the token
) -> None:
    """Write each token's K and V into its cache slot, in place."""
    num_tokens, num_kv_heads, head_dim = key.shape
    assert value.shape == key.shape, "key and value must have the same shape"
    assert k_cache.shape == v_cache.shape and k_cache.stride() == v_cache.stride()
    assert k_cache.shape[2:] == (num_kv_heads, head_dim), "cache heads/head_dim mismatch"
    assert key.stride(2) == 1 and value.stride(2) == 1 and k_cache.stride(3) == 1
    if num_tokens == 0:
        return
    _write_kv_kernel[(num_tokens,)](
        key,
        value,
        k_cache,
        v_cache,
        slot_mapping,
        key.stride(0),
        key.stride(1),
        value.stride(0),
        value.stride(1),
        k_cache.stride(0),
        k_cache.stride(1),
        k_cache.stride(2),
        NUM_KV_HEADS=num_kv_heads,
        HEAD_DIM=head_dim,
        BLOCK_SIZE=k_cache.shape[1],
        BLOCK_H=triton.next_power_of_2(num_kv_heads),
        BLOCK_D=triton.next_power_of_2(head_dim),
        TO_FP8=k_cache.dtype == torch.float8_e4m3fn,
    )
