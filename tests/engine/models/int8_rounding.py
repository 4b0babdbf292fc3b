"""The C++ products' int8 activations (cpu_decode.cpp) in torch, as test references: a
product of more rows than `int8_activation_rows` gives over quantized panels equals the
dequantized weights times its input rounded per block of 32 inputs to 127 steps of the
block's largest magnitude."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F
from torch import nn

from engine.models import cpu_decode
from engine.models.quantized.panels import PanelMatrix


def rounded_activations(x: torch.Tensor) -> torch.Tensor:
    """x [..., K] (K a multiple of 32) as the kernels round it: d q, d = max |x| / 127 per
    block, q = round(x * (127 / max |x|)) (half to even), in float32 as the kernels do."""
    blocks = x.reshape(*x.shape[:-1], -1, 32)
    largest = blocks.abs().amax(-1, keepdim=True)
    # A true division: `127.0 / largest` is reciprocal(largest) * 127, a rounding apart.
    inverse = torch.where(largest > 0, torch.full_like(largest, 127.0) / largest,
                          torch.zeros_like(largest))
    return (torch.round(blocks * inverse) * (largest / 127.0)).reshape(x.shape)


def product_input(x: torch.Tensor, matrix: PanelMatrix) -> torch.Tensor:
    """x as a product of x.shape[0] rows over `matrix` (one format) takes it."""
    rows = cpu_decode.int8_activation_rows(matrix.format)
    return rounded_activations(x) if rows is not None and x.shape[0] > rows else x


@contextmanager
def rounded_like(model: nn.Module, stored: nn.Module) -> Iterator[None]:
    """While open, each nn.Linear of `model` whose namesake in `stored` is a PanelLinear takes
    its input as that module's products do (part by part for a stack of formats), so `model`
    over the dequantized weights is the reference for `stored`."""
    handles = []
    for name, module in model.named_modules():
        try:
            panel = stored.get_submodule(name)
        except AttributeError:
            continue
        if not isinstance(module, nn.Linear) or not isinstance(panel, cpu_decode.PanelLinear):
            continue
        parts = list(panel.panels.parts) or [panel.panels]

        def hook(linear: nn.Linear, args: tuple[Any, ...], output: torch.Tensor,
                 parts: list[PanelMatrix] = parts) -> torch.Tensor:
            x = args[0].reshape(-1, linear.in_features)
            outs, first = [], 0
            for part in parts:
                rows = slice(first, first + part.out_features)
                bias = None if linear.bias is None else linear.bias[rows]
                outs.append(F.linear(product_input(x, part), linear.weight[rows], bias))
                first += part.out_features
            return torch.cat(outs, dim=-1).view(output.shape)

        handles.append(module.register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()
