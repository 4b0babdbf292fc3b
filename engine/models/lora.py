"""Batched LoRA: one step's tokens on several adapters and on the base model.

The decoder runs four products per layer over fused weights (qkv, o, gate_up, down). An
adapter's update of a fused product is two products of its own: `x @ A^T` (the shrink, A
stacked over the product's targets, [R, in]) and `h @ B^T` (the expand, B block-diagonal
over the targets, [N, R], scaling folded in), added to the base product's output before
anything reads it (q/k norms and RoPE, SiLU-and-multiply).

Adapters sit in a fixed number of slots (`LoraSlots`); the runner binds each step's tokens
to slots (`bind`, -1: the base model) and every adapted product adds, for each slot the step
uses, its update to that slot's rows: with the slots' kernels where the device has them
(`SlotKernels`: Triton on CUDA, cpu_decode.cpp's on the CPU in float32), else as grouped torch
products (one shrink and one expand per slot in the step), the fallback and the tests'
reference. Costs grow with the tokens on adapters and the distinct adapters of the step, not
with the adapters registered. The CPU decode forward (engine.models.cpu_decode) runs the CPU
kernels inside its own products, on the bound step's plan (`kernel_plan`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np
import torch

from engine.models.config import ModelConfig

__all__ = [
    "FUSED_TARGETS",
    "LoraMatrices",
    "LoraSlots",
    "LoraWeights",
    "SlotKernels",
    "target_shapes",
]

# The decoder's fused products and the HF modules each fuses, in its output order.
FUSED_TARGETS: dict[str, tuple[str, ...]] = {
    "qkv": ("q_proj", "k_proj", "v_proj"),
    "o": ("o_proj",),
    "gate_up": ("gate_proj", "up_proj"),
    "down": ("down_proj",),
}


def target_shapes(config: ModelConfig) -> dict[str, tuple[int, int]]:
    """(in, out) features of each HF module an adapter may target, in a model of config."""
    e, i = config.hidden_size, config.intermediate_size
    return {"q_proj": (e, config.q_size), "k_proj": (e, config.kv_size),
            "v_proj": (e, config.kv_size), "o_proj": (config.q_size, e),
            "gate_proj": (e, i), "up_proj": (e, i), "down_proj": (i, e)}


@dataclass(frozen=True)
class LoraMatrices:
    """One adapter's update of one fused product of one layer."""

    a_t: torch.Tensor  # [in, R]: A^T, the targets' A stacked (R = the sum of their ranks)
    b_t: torch.Tensor  # [R, N]: B^T, block-diagonal over the targets, scaling folded in
    # Each of the product's targets' rank, FUSED_TARGETS order, 0 where the adapter lacks it:
    # the blocks of b_t (target t's rows follow the earlier targets', its columns its own).
    ranks: tuple[int, ...]


@dataclass
class LoraWeights:
    """An adapter in the decoder's layout: per layer, fused product -> its update (absent
    where the adapter targets none of that product's modules)."""

    layers: list[dict[str, LoraMatrices]]

    @property
    def nbytes(self) -> int:
        return sum(m.a_t.nbytes + m.b_t.nbytes for layer in self.layers for m in layer.values())

    @classmethod
    def fuse(
        cls,
        layers: list[dict[str, tuple[torch.Tensor, torch.Tensor]]],
        out_features: dict[str, int],
        dtype: torch.dtype,
        device: torch.device,
    ) -> LoraWeights:
        """From per-layer HF module name -> (A [r, in], B [out, r] scaled); out_features:
        each module's output width (a target an adapter lacks still takes its columns)."""
        fused_layers: list[dict[str, LoraMatrices]] = []
        for modules in layers:
            fused: dict[str, LoraMatrices] = {}
            for product, names in FUSED_TARGETS.items():
                present = [name for name in names if name in modules]
                if not present:
                    continue
                a = torch.cat([modules[name][0] for name in present], dim=0)  # [R, in]
                b_t = torch.zeros(a.shape[0], sum(out_features[n] for n in names))
                row = column = 0
                for name in names:
                    width = out_features[name]
                    if name in modules:
                        b = modules[name][1]  # [out, r]
                        b_t[row : row + b.shape[1], column : column + width] = b.t()
                        row += b.shape[1]
                    column += width
                fused[product] = LoraMatrices(
                    a.t().contiguous().to(device=device, dtype=dtype),
                    b_t.to(device=device, dtype=dtype),
                    tuple(modules[n][0].shape[0] if n in modules else 0 for n in names),
                )
            fused_layers.append(fused)
        return cls(fused_layers)


class SlotKernels(Protocol):
    """Kernels that apply every slot's update in a few launches (engine.models.triton_lora's
    TritonLoraStack on CUDA, engine.models.cpu_decode_lora's CpuLoraKernels on the CPU): they
    keep their own copy of each slot's weights."""

    def set_slot(self, slot: int, weights: LoraWeights | None) -> None: ...

    def plan(self, token_slots: np.ndarray) -> object: ...

    def apply(self, layer: int, product: str, x: torch.Tensor, out: torch.Tensor,
              plan: Any) -> None: ...


class LoraSlots:
    """The adapters a step may use, one per slot, and the current step's tokens by slot."""

    def __init__(self, num_slots: int, device: torch.device,
                 kernels: SlotKernels | None = None) -> None:
        """kernels: apply the updates with them instead of grouped torch products."""
        self.device = device
        self.kernels = kernels
        # The kernels' plan of the bound step: made at the first `add` (a step a captured
        # graph runs never needs it), or bound ready-made (`bind_plan`).
        self._plan: object = None
        self._bound_plan = False
        self.weights: list[LoraWeights | None] = [None] * num_slots
        # The bound step's slot per token (int64[T], -1: the base model), None when no token
        # is on an adapter; its groups for `add` (slot, its token rows or None for every row),
        # made at the first `add`: a step the CPU decode forward runs never needs them.
        self.token_slots: np.ndarray | None = None
        self._groups: list[tuple[LoraWeights, torch.Tensor | None]] | None = []

    @property
    def num_slots(self) -> int:
        return len(self.weights)

    def set_slot(self, slot: int, weights: LoraWeights | None) -> None:
        """An adapter enters slot (None: it is emptied)."""
        self.weights[slot] = weights
        if self.kernels is not None:
            self.kernels.set_slot(slot, weights)

    @property
    def active(self) -> bool:
        """The bound step has tokens on an adapter."""
        return self.token_slots is not None or self._bound_plan

    def bind(self, token_slots: np.ndarray | None) -> None:
        """The step's slot of each token (int64[T], -1: the base model); None: no token on
        an adapter."""
        self._plan, self._bound_plan = None, False
        if token_slots is None or not bool((token_slots >= 0).any()):
            self.token_slots, self._groups = None, []
            return
        self.token_slots = np.ascontiguousarray(token_slots, dtype=np.int64)
        self._groups = None

    def bind_plan(self, plan: object) -> None:
        """The kernels' plan of a step, ready-made: a captured decode graph's plan over its
        static buffers (engine.worker.cuda_graphs), bound while the graph's forward runs."""
        assert self.kernels is not None
        self.token_slots, self._groups = None, []
        self._plan, self._bound_plan = plan, True

    def _grouped(self) -> list[tuple[LoraWeights, torch.Tensor | None]]:
        """The bound step's tokens by slot (made once per step)."""
        if self._groups is not None:
            return self._groups
        token_slots = self.token_slots
        assert token_slots is not None
        groups: list[tuple[LoraWeights, torch.Tensor | None]] = []
        first = int(token_slots[0])
        if bool((token_slots == first).all()):
            groups.append((self._weights(first), None))
        else:
            for slot in np.unique(token_slots):
                if slot < 0:
                    continue
                rows = torch.from_numpy(np.flatnonzero(token_slots == slot))
                groups.append((self._weights(int(slot)), rows.to(self.device)))
        self._groups = groups
        return groups

    def _weights(self, slot: int) -> LoraWeights:
        weights = self.weights[slot]
        assert weights is not None, f"LoRA slot {slot} is empty"
        return weights

    def kernel_plan(self) -> object:
        """The kernels' plan of the bound step, made at its first use (once a step)."""
        assert self.kernels is not None
        if self._plan is None:
            assert self.token_slots is not None
            self._plan = self.kernels.plan(self.token_slots)
        return self._plan

    def add(self, layer: int, product: str, x: torch.Tensor, out: torch.Tensor) -> None:
        """out += each bound adapter's update of `product` in `layer`, on its rows of x
        ([T, in] -> out [T, N])."""
        if self.kernels is not None:
            self.kernels.apply(layer, product, x, out, self.kernel_plan())
            return
        for weights, rows in self._grouped():
            matrices = weights.layers[layer].get(product)
            if matrices is None:
                continue
            if rows is None:
                out.addmm_(x @ matrices.a_t, matrices.b_t)
            else:
                update = x.index_select(0, rows) @ matrices.a_t @ matrices.b_t
                out.index_add_(0, rows, update)
