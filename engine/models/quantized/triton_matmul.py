# mypy: allow-untyped-defs
"""Triton kernels of QuantizedLinear: y = x W^T (+ b) with W dequantized block by block.

x is [M, K] in float32, bfloat16 or float16; the product accumulates in float32 and is written
in x's dtype. Neither kernel ever writes W in float: each program loads the packed tiles of
its columns and turns them into x's dtype in registers.

- integer weights (int4/int8, the layout of engine.models.quantized.linear): a K block lies in
  one group (it divides the group size), so the block's dot product runs over the exact small
  integers q - zero (exact in bfloat16 and float16 too) and is scaled once per output column.
- fp8 weights: float8_e4m3fn converts exactly to bfloat16 and float16; the per-output scale is
  applied to the finished sum.

Decode steps (M of a few rows) take blocks of 16 rows and narrow column blocks, so that even
one row spreads over many programs; prefills take wider row blocks.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from engine.attention.triton_paged_tile import needs_fp32_dot
from engine.models.quantized.linear import QuantizedLinear, WeightKind

__all__ = ["fp8_matmul", "int_matmul", "quantized_matmul"]


@triton.jit
def _int_matmul_kernel(
    x_ptr, qweight_ptr, zeros_ptr, scales_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_om,
    BITS: tl.constexpr, GROUP_SIZE: tl.constexpr, HAS_BIAS: tl.constexpr,
    DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    PACK: tl.constexpr = 32 // BITS
    MASK: tl.constexpr = (1 << BITS) - 1
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):  # K is whole groups, a group whole K blocks
        offs_k = k0 + tl.arange(0, BLOCK_K)
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None], other=0.0)  # [BLOCK_M, BLOCK_K]
        if UPCAST:
            x = x.to(tl.float32)
        # every input's word: a row of qweight read PACK times, from cache after the first
        words = tl.load(qweight_ptr + (offs_k[:, None] // PACK) * N + offs_n[None, :],
                        mask=mask_n[None, :], other=0)  # int32 [BLOCK_K, BLOCK_N]
        q = (words >> ((offs_k[:, None] % PACK) * BITS)) & MASK
        group = k0 // GROUP_SIZE
        zero = tl.load(zeros_ptr + group * N + offs_n, mask=mask_n, other=0).to(tl.int32)
        scale = tl.load(scales_ptr + group * N + offs_n, mask=mask_n, other=0.0).to(tl.float32)
        w = (q - zero[None, :]).to(x.dtype)  # exact: |q - zero| <= 255
        partial = tl.dot(x, w, input_precision=DOT_PRECISION, out_dtype=tl.float32)
        acc += partial * scale[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


@triton.jit
def _fp8_matmul_kernel(
    x_ptr, weight_ptr, scales_ptr, bias_ptr, out_ptr,
    M, N, K,
    stride_xm, stride_xk, stride_om,
    HAS_BIAS: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
):
    offs_m = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask_m, mask_n = offs_m < M, offs_n < N
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        mask_k = offs_k < K
        x = tl.load(x_ptr + offs_m[:, None] * stride_xm + offs_k[None, :] * stride_xk,
                    mask=mask_m[:, None] & mask_k[None, :], other=0.0)  # [BLOCK_M, BLOCK_K]
        if UPCAST:
            x = x.to(tl.float32)
        w = tl.load(weight_ptr + offs_n[None, :] * K + offs_k[:, None],
                    mask=mask_n[None, :] & mask_k[:, None], other=0.0)  # fp8 [BLOCK_K, BLOCK_N]
        acc += tl.dot(x, w.to(x.dtype), input_precision=DOT_PRECISION, out_dtype=tl.float32)
    acc *= tl.load(scales_ptr + offs_n, mask=mask_n, other=0.0)[None, :]
    if HAS_BIAS:
        acc += tl.load(bias_ptr + offs_n, mask=mask_n, other=0.0).to(tl.float32)[None, :]
    tl.store(out_ptr + offs_m[:, None] * stride_om + offs_n[None, :],
             acc.to(out_ptr.dtype.element_ty), mask=mask_m[:, None] & mask_n[None, :])


def _blocks(num_rows: int, max_block_k: int) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, BLOCK_K, num_warps) for M rows: decode steps spread one row's
    columns over many programs; prefills reuse each dequantized tile over more rows."""
    if num_rows <= 16:
        return 16, 32, min(max_block_k, 128), 4
    if num_rows <= 32:
        return 32, 64, min(max_block_k, 64), 4
    return 64, 64, min(max_block_k, 64), 4


def _launch_shape(x: torch.Tensor, num_out: int) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """x as [M, K] (a view where it can be), the output [M, N], and whether the dot products
    run on float32 tiles (float32 models, and bfloat16 under the interpreter)."""
    x2 = x.reshape(-1, x.shape[-1])
    out = torch.empty(x2.shape[0], num_out, dtype=x.dtype, device=x.device)
    return x2, out, x.dtype == torch.float32 or needs_fp32_dot(x.dtype)


def _precision(is_fp32_dot: bool) -> str:
    # float32 tiles multiply in full float32 (tf32 would round the inputs to 10 bits)
    return "ieee" if is_fp32_dot else "tf32"


def int_matmul(x: torch.Tensor, qweight: torch.Tensor, zeros: torch.Tensor,
               scales: torch.Tensor, bias: torch.Tensor | None, bits: int,
               group_size: int) -> torch.Tensor:  # [..., K] -> [..., N]
    """x W^T (+ bias) over the integer layout (engine.models.quantized.linear)."""
    assert qweight.is_contiguous() and zeros.is_contiguous() and scales.is_contiguous()
    num_out = qweight.shape[1]
    num_in = qweight.shape[0] * (32 // bits)
    x2, out, is_fp32_dot = _launch_shape(x, num_out)
    num_rows = x2.shape[0]
    if num_rows:
        block_m, block_n, block_k, num_warps = _blocks(num_rows, group_size)
        grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_out, block_n))
        _int_matmul_kernel[grid](
            x2, qweight, zeros, scales, bias if bias is not None else out, out,
            num_rows, num_out, num_in, x2.stride(0), x2.stride(1), out.stride(0),
            BITS=bits, GROUP_SIZE=group_size, HAS_BIAS=bias is not None,
            DOT_PRECISION=_precision(is_fp32_dot), UPCAST=is_fp32_dot,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
            num_warps=num_warps,
        )
    return out.view(*x.shape[:-1], num_out)


def fp8_matmul(x: torch.Tensor, weight: torch.Tensor, scales: torch.Tensor,
               bias: torch.Tensor | None) -> torch.Tensor:  # [..., K] -> [..., N]
    """x W^T (+ bias) over the fp8 layout (engine.models.quantized.linear)."""
    assert weight.is_contiguous() and scales.is_contiguous()
    num_out, num_in = weight.shape
    x2, out, is_fp32_dot = _launch_shape(x, num_out)
    num_rows = x2.shape[0]
    if num_rows:
        block_m, block_n, block_k, num_warps = _blocks(num_rows, 128)
        grid = (triton.cdiv(num_rows, block_m), triton.cdiv(num_out, block_n))
        _fp8_matmul_kernel[grid](
            x2, weight, scales, bias if bias is not None else out, out,
            num_rows, num_out, num_in, x2.stride(0), x2.stride(1), out.stride(0),
            HAS_BIAS=bias is not None, DOT_PRECISION=_precision(is_fp32_dot),
            UPCAST=is_fp32_dot,
            BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k, num_warps=num_warps,
        )
    return out.view(*x.shape[:-1], num_out)


def quantized_matmul(x: torch.Tensor, linear: QuantizedLinear) -> torch.Tensor:
    """The module's product in the kernel of its format."""
    if linear.format.kind is WeightKind.FP8:
        return fp8_matmul(x, linear.qweight, linear.scales, linear.bias)
    assert linear.zeros is not None
    return int_matmul(x, linear.qweight, linear.zeros, linear.scales, linear.bias,
                      linear.format.bits, linear.format.group_size)
