# mypy: allow-untyped-defs
# (Triton reads kernel annotations as specialisation hints, so @triton.jit functions stay bare.)
"""Triton kernel: the residual add and the RMSNorm after it, in one pass over the rows.

A decoder layer adds each sublayer's output to the residual stream and normalises the sum
(RMSNorm.add_and_norm). Done as torch ops that is an add kernel, then a norm that reads the sum
again; the fused kernel reads x and the residual once, writes the sum back into the residual
(in place) and the normalised row to a new tensor. The arithmetic follows HF's order: the sum is
rounded to the activation dtype, normalised in float32, rounded, then scaled by the weight.
The CUDA path of the decoder (CausalLM.use_fused_cuda_ops); the tests run it under the Triton
interpreter on the CPU.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

__all__ = ["add_rms_norm"]


@triton.jit
def _add_rms_norm_kernel(
    x_ptr,  # [T, E]
    residual_ptr,  # [T, E], becomes residual + x
    weight_ptr,  # [E]
    out_ptr,  # [T, E]
    stride_x,
    stride_r,
    stride_o,
    eps,
    HIDDEN: tl.constexpr,
    BLOCK: tl.constexpr,  # next power of two >= HIDDEN
):
    row = tl.program_id(0)
    offs = tl.arange(0, BLOCK)
    mask = offs < HIDDEN
    x = tl.load(x_ptr + row * stride_x + offs, mask=mask, other=0.0).to(tl.float32)
    r = tl.load(residual_ptr + row * stride_r + offs, mask=mask, other=0.0).to(tl.float32)
    total = (x + r).to(residual_ptr.dtype.element_ty)  # the sum in the activation dtype
    tl.store(residual_ptr + row * stride_r + offs, total, mask=mask)
    h = total.to(tl.float32)
    variance = tl.sum(h * h, axis=0) / HIDDEN
    normed = (h * tl.rsqrt(variance + eps)).to(out_ptr.dtype.element_ty).to(tl.float32)
    weight = tl.load(weight_ptr + offs, mask=mask, other=0.0).to(tl.float32)
    tl.store(out_ptr + row * stride_o + offs, (weight * normed).to(out_ptr.dtype.element_ty),
             mask=mask)


def add_rms_norm(
    x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """residual += x (in place); returns rms_norm(residual) * weight, both [T, E]."""
    assert x.shape == residual.shape and x.dim() == 2 and weight.shape == (x.shape[1],)
    assert x.stride(1) == 1 and residual.stride(1) == 1 and weight.is_contiguous()
    out = torch.empty_like(residual)
    num_tokens, hidden = x.shape
    if num_tokens:
        _add_rms_norm_kernel[(num_tokens,)](
            x, residual, weight, out, x.stride(0), residual.stride(0), out.stride(0), eps,
            HIDDEN=hidden, BLOCK=triton.next_power_of_2(hidden),
        )
    return out
