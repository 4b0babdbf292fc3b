"""QuantizedLinear: y = x W^T + b over a weight-only quantized matrix held as stored.

Two canonical layouts, whatever checkpoint format they came from (engine.models.quantized.
layouts repacks AWQ and GPTQ into the first, fp8 checkpoints are already the second):

- integer (`WeightKind.INT`, 4 or 8 bits): `qweight` int32 [K * bits / 32, N], packed along
  the inputs in order (input k sits in row k // (32 / bits), bits (k % (32 / bits)) * bits
  up), `zeros` uint8 [K / G, N] the real zero points, `scales` float16 or bfloat16 [K / G, N];
  W[n, k] = (q[k, n] - zeros[k // G, n]) * scales[k // G, n]. Packing along the inputs keeps
  every output a column, so fused q/k/v (gate/up) are the shards' columns side by side.
- fp8 (`WeightKind.FP8`): `qweight` float8_e4m3fn [N, K], `scales` float32 [N] (a per-tensor
  scale repeated over its rows); W[n, k] = float(qweight[n, k]) * scales[n].

On CUDA the product runs in Triton kernels that dequantize blocks of W in registers
(engine.models.quantized.triton_matmul). Elsewhere the forward dequantizes the whole matrix
with the torch reference below and multiplies: correct but slow, and it holds one float copy of
one matrix for the duration of the call. The reference is what the kernels are tested against.
"""

from __future__ import annotations

from dataclasses import dataclass
from enum import Enum

import torch
import torch.nn.functional as F
from torch import nn

__all__ = [
    "QuantizedFormat",
    "QuantizedLinear",
    "WeightKind",
    "dequantize_fp8",
    "dequantize_int",
]


class WeightKind(Enum):
    INT = "int"  # packed integers, group scales and zero points
    FP8 = "fp8"  # float8_e4m3fn, a scale per output


@dataclass(frozen=True)
class QuantizedFormat:
    """How a QuantizedLinear holds its matrix."""

    kind: WeightKind
    bits: int  # 4 or 8 (fp8: 8)
    group_size: int  # inputs per scale and zero point (fp8: 0, a scale per output)
    scale_dtype: torch.dtype  # the dtype of `scales` (float16/bfloat16 as stored; fp8: float32)
    name: str  # what the checkpoint stored, e.g. "awq-int4-g128" (TorchModelRunner.weight_format)

    def __post_init__(self) -> None:
        assert self.kind is WeightKind.FP8 or self.bits in (4, 8), "int4 or int8"

    @property
    def pack(self) -> int:
        """Integer values per int32 word."""
        return 32 // self.bits


def dequantize_int(qweight: torch.Tensor, zeros: torch.Tensor, scales: torch.Tensor,
                   bits: int, group_size: int) -> torch.Tensor:  # float32 [N, K]
    """The integer layout's matrix in float32 (the torch reference)."""
    pack = 32 // bits
    shifts = torch.arange(pack, dtype=torch.int32, device=qweight.device) * bits
    q = (qweight.unsqueeze(1) >> shifts.view(1, pack, 1)) & ((1 << bits) - 1)
    q = q.reshape(-1, qweight.shape[1])  # [K, N]
    zero = zeros.to(torch.int32).repeat_interleave(group_size, dim=0)  # [K, N]
    scale = scales.float().repeat_interleave(group_size, dim=0)
    return ((q - zero).float() * scale).t()


def dequantize_fp8(qweight: torch.Tensor, scales: torch.Tensor) -> torch.Tensor:  # [N, K]
    """The fp8 layout's matrix in float32 (the torch reference)."""
    return qweight.float() * scales.float().unsqueeze(1)


class QuantizedLinear(nn.Module):
    """y = x W^T + b with W in one of the canonical quantized layouts (inference only).

    The tensors are buffers, allocated empty here (on `device`; "meta" while a model is built)
    and filled by the loader (engine.models.quantized.loading); the bias is a parameter in the
    model's dtype, so engine.models.loader.load_weights fills it like any other.
    """

    def __init__(self, in_features: int, out_features: int, weight_format: QuantizedFormat,
                 has_bias: bool, bias_dtype: torch.dtype,
                 device: torch.device | str | None = None) -> None:
        super().__init__()
        self.in_features, self.out_features = in_features, out_features
        self.format = weight_format
        k, n = in_features, out_features
        if weight_format.kind is WeightKind.INT:
            assert k % weight_format.group_size == 0, "whole groups of inputs"
            num_groups = k // weight_format.group_size
            qweight = torch.empty(k // weight_format.pack, n, dtype=torch.int32, device=device)
            zeros = torch.empty(num_groups, n, dtype=torch.uint8, device=device)
            scales = torch.empty(num_groups, n, dtype=weight_format.scale_dtype, device=device)
        else:
            qweight = torch.empty(n, k, dtype=torch.float8_e4m3fn, device=device)
            zeros = None
            scales = torch.empty(n, dtype=torch.float32, device=device)
        self.qweight: torch.Tensor
        self.zeros: torch.Tensor | None
        self.scales: torch.Tensor
        self.register_buffer("qweight", qweight)
        self.register_buffer("zeros", zeros)
        self.register_buffer("scales", scales)
        self.bias = None if not has_bias else nn.Parameter(
            torch.empty(n, dtype=bias_dtype, device=device), requires_grad=False)
        self.use_triton = False  # the kernels off CUDA too (tests, under the interpreter)

    @property
    def output_dim(self) -> int:
        """The dimension of qweight, zeros and scales that runs over the outputs."""
        return 1 if self.format.kind is WeightKind.INT else 0

    def dequantized(self) -> torch.Tensor:  # float32 [N, K]
        """The matrix in float32 (the torch reference of the kernels)."""
        if self.format.kind is WeightKind.FP8:
            return dequantize_fp8(self.qweight, self.scales)
        assert self.zeros is not None
        return dequantize_int(self.qweight, self.zeros, self.scales, self.format.bits,
                              self.format.group_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., K] -> [..., N]
        if x.is_cuda or self.use_triton:
            from engine.models.quantized.triton_matmul import quantized_matmul

            return quantized_matmul(x, self)
        return F.linear(x, self.dequantized().to(x.dtype), self.bias)

    def extra_repr(self) -> str:
        return f"in_features={self.in_features}, out_features={self.out_features}, " \
               f"format={self.format.name}, bias={self.bias is not None}"
