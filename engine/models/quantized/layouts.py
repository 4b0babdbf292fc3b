"""Quantized checkpoint tensors of one projection, repacked into QuantizedLinear's layouts.

Published layouts read here, for a projection of K inputs and N outputs and groups of G inputs:

- AWQ GEMM (AutoAWQ): `qweight` int32 [K, N / 8], eight outputs per word along N in the
  nibble order [0, 2, 4, 6, 1, 3, 5, 7] (nibble i, bits 4i up, holds output 8c + order[i]);
  `qzeros` int32 [K / G, N / 8] in the same order, the real zero points; `scales` [K / G, N].
- GPTQ (AutoGPTQ, GPTQModel): `qweight` int32 [K * bits / 32, N], 32 / bits inputs per word
  along K in order from the low bits; `qzeros` int32 [K / G, N * bits / 32] packed along N in
  order; `scales` [K / G, N]; `g_idx` int32 [K], each input's group. Format v1 stores every
  zero point minus one (wrapping modulo 2^bits), v2 the zero point itself.
- fp8 (HF / vLLM "fp8"): `weight` float8_e4m3fn [N, K] and `weight_scale` float32, one value
  (per tensor) or [N] / [N, 1] (per channel).

Every result is the integers or fp8 values as stored, never a float matrix.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.models.config import ModelConfigError, QuantizationConfigError

__all__ = ["AWQ_ORDER", "QuantizedTensors", "from_awq", "from_fp8", "from_gptq"]

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of an AWQ word holds output 8c + AWQ_ORDER[i]


@dataclass(frozen=True)
class QuantizedTensors:
    """One projection's matrix in a QuantizedLinear layout (engine.models.quantized.linear)."""

    qweight: torch.Tensor  # int32 [K * bits / 32, N], or float8_e4m3fn [N, K]
    scales: torch.Tensor  # [K / G, N] as stored, or float32 [N]
    zeros: torch.Tensor | None  # uint8 [K / G, N] real zero points; None for fp8


def _expect(name: str, tensor: torch.Tensor, shape: tuple[int, ...],
            dtypes: tuple[torch.dtype, ...]) -> None:
    if tuple(tensor.shape) != shape:
        raise ModelConfigError(f"{name}: checkpoint shape {tuple(tensor.shape)}, "
                               f"model expects {shape}")
    if tensor.dtype not in dtypes:
        raise ModelConfigError(f"{name}: dtype {tensor.dtype}, expected one of {dtypes}")


def _unpack_columns(words: torch.Tensor, bits: int, order: tuple[int, ...]) -> torch.Tensor:
    """int32 [R, C] packed along columns -> int32 [R, C * 32 / bits]; column p of each word
    sits in field order.index(p)."""
    fields = torch.tensor([order.index(p) for p in range(len(order))], dtype=torch.int32)
    values = (words.unsqueeze(-1) >> (fields * bits)) & ((1 << bits) - 1)  # [R, C, pack]
    return values.reshape(words.shape[0], -1)


def _pack_rows(values: torch.Tensor, bits: int) -> torch.Tensor:
    """int32 [K, N] of values below 2^bits -> int32 [K * bits / 32, N], rows in order."""
    pack = 32 // bits
    fields = values.view(-1, pack, values.shape[1])
    words = torch.zeros(fields.shape[0], fields.shape[2], dtype=torch.int32)
    for i in range(pack):  # << wraps into the sign bit for the top field, as intended
        words |= fields[:, i] << (i * bits)
    return words


def from_awq(name: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
             num_in: int, num_out: int, group_size: int) -> QuantizedTensors:
    """An AWQ GEMM projection (`name`: its HF module) in the integer layout."""
    num_groups = num_in // group_size
    _expect(f"{name}.qweight", qweight, (num_in, num_out // 8), (torch.int32,))
    _expect(f"{name}.qzeros", qzeros, (num_groups, num_out // 8), (torch.int32,))
    _expect(f"{name}.scales", scales, (num_groups, num_out), (torch.float16, torch.bfloat16))
    values = _unpack_columns(qweight, 4, AWQ_ORDER)  # [K, N]
    zeros = _unpack_columns(qzeros, 4, AWQ_ORDER).to(torch.uint8)
    return QuantizedTensors(_pack_rows(values, 4), scales.contiguous(), zeros)


def from_gptq(name: str, qweight: torch.Tensor, qzeros: torch.Tensor, scales: torch.Tensor,
              g_idx: torch.Tensor | None, num_in: int, num_out: int, bits: int,
              group_size: int, zero_offset: int) -> QuantizedTensors:
    """A GPTQ projection (`name`: its HF module) in the integer layout: its qweight already
    is; zero points are unpacked and corrected by zero_offset. Act-order (a g_idx other than
    input // group_size) is refused."""
    pack, num_groups = 32 // bits, num_in // group_size
    _expect(f"{name}.qweight", qweight, (num_in // pack, num_out), (torch.int32,))
    _expect(f"{name}.qzeros", qzeros, (num_groups, num_out // pack), (torch.int32,))
    _expect(f"{name}.scales", scales, (num_groups, num_out), (torch.float16, torch.bfloat16))
    if g_idx is not None:
        _expect(f"{name}.g_idx", g_idx, (num_in,), (torch.int32, torch.int64))
        if not torch.equal(g_idx.long(), torch.arange(num_in) // group_size):
            raise QuantizationConfigError(
                f"{name}.g_idx is not input // group_size: act-order (desc_act) GPTQ "
                "checkpoints are not supported")
    zeros = (_unpack_columns(qzeros, bits, tuple(range(pack))) + zero_offset) & ((1 << bits) - 1)
    return QuantizedTensors(qweight.contiguous(), scales.contiguous(), zeros.to(torch.uint8))


def from_fp8(name: str, weight: torch.Tensor, weight_scale: torch.Tensor, num_in: int,
             num_out: int) -> QuantizedTensors:
    """An fp8 projection (`name`: its HF module): its weight as stored, its scale per row."""
    _expect(f"{name}.weight", weight, (num_out, num_in), (torch.float8_e4m3fn,))
    if weight_scale.numel() == 1:
        scales = weight_scale.reshape(1).float().expand(num_out)
    elif weight_scale.numel() == num_out and weight_scale.dim() in (1, 2):
        scales = weight_scale.reshape(num_out).float()
    else:
        raise ModelConfigError(f"{name}.weight_scale: shape {tuple(weight_scale.shape)}, "
                               f"expected one value or one per output ({num_out})")
    return QuantizedTensors(weight.contiguous(), scales.contiguous(), None)
