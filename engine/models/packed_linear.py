"""CPU linear layers on oneDNN-prepacked weights.

On the CPU, `F.linear` re-packs the weight matrix on every call through MKL; for the few-row
matmuls of decode steps that packing costs as much as the product itself. oneDNN can pack a
weight once into its blocked layout and reuse it, which is what torch.compile's CPU "freezing"
does with the same two ops. They are private ATen ops, so `pack_linear_layers` checks each
packed layer against F.linear once and keeps the plain layer if the op is missing or disagrees.
"""

from __future__ import annotations

import logging

import torch
import torch.nn.functional as F
from torch import nn

__all__ = ["PackedLinear", "pack_linear_layers", "packing_available"]

logger = logging.getLogger(__name__)

# Packed results differ from F.linear by rounding only (another summation order).
_CHECK_ATOL = 1e-3
_CHECK_RTOL = 1e-3


def packing_available(device: torch.device, dtype: torch.dtype) -> bool:
    """oneDNN prepacking applies to float32 and bfloat16 weights on an x86 CPU build."""
    return (
        device.type == "cpu"
        and dtype in (torch.float32, torch.bfloat16)
        and torch.backends.mkldnn.is_available()
        and hasattr(torch.ops.mkldnn, "_linear_pointwise")
    )


class PackedLinear(nn.Module):
    """y = x W^T + b with W held in oneDNN's packed layout (inference only)."""

    def __init__(self, linear: nn.Linear, batch_size_hint: int) -> None:
        super().__init__()
        self.in_features, self.out_features = linear.in_features, linear.out_features
        with torch.no_grad():
            # Opaque mkldnn tensor [out, in]; the hint picks the blocking (any M works).
            self.packed_weight = torch.ops.mkldnn._reorder_linear_weight(
                linear.weight.detach(), batch_size_hint
            )
        self.bias = None if linear.bias is None else linear.bias.detach().clone()

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # [..., in] -> [..., out]
        out: torch.Tensor = torch.ops.mkldnn._linear_pointwise(
            x, self.packed_weight, self.bias, "none", [], ""
        )
        return out


def _agrees(linear: nn.Linear, packed: PackedLinear) -> bool:
    weight = linear.weight
    generator = torch.Generator().manual_seed(0)
    x = torch.randn(3, linear.in_features, generator=generator).to(weight.dtype)
    expected = F.linear(x, weight, linear.bias).float()
    return torch.allclose(packed(x).float(), expected, rtol=_CHECK_RTOL, atol=_CHECK_ATOL)


def pack_linear_layers(model: nn.Module, batch_size_hint: int) -> int:
    """Replace every nn.Linear of model by a PackedLinear where that is supported and checks
    out; returns how many were packed. Tied weights keep their nn.Embedding (the packed copy is
    separate), so a tied lm_head costs its matrix twice."""
    targets = [
        (parent, name, child)
        for parent in model.modules()
        for name, child in parent.named_children()
        if isinstance(child, nn.Linear)
    ]
    num_packed = 0
    for parent, name, linear in targets:
        if not packing_available(linear.weight.device, linear.weight.dtype):
            continue
        try:
            packed = PackedLinear(linear, batch_size_hint)
            is_ok = _agrees(linear, packed)
        except RuntimeError as exc:  # op missing from this build
            logger.warning("oneDNN weight packing unavailable (%s); using F.linear", exc)
            return num_packed
        if is_ok:
            setattr(parent, name, packed)
            num_packed += 1
        else:
            logger.warning("packed %s disagrees with F.linear; keeping it unpacked", name)
    return num_packed
