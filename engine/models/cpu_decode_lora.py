"""LoRA adapters in the CPU decode forward's layout (cpu_decode.cpp's TiergateLora* structs).

The decode kernel adds each row's adapter update inside its own products, BGMV style: a
shrink h = A x for each row on an adapter (A in panels of 16 ranks, [R16 / 16][in][16], zero
rows past the rank), then, in each thread's share of the base product's output panels,
out[panel] += B[panel] h. B is block-diagonal over a fused product's targets (q, k, v; gate,
up), so each output panel keeps only its target's block, [rank][16], and where that target's
rows of h start: no multiply-adds over the zero blocks, none for a target the adapter lacks.

The layout is a second copy of an adapter (about its size: A padded to 16 ranks, B without
its zero blocks), made when the adapter enters a slot (`DecodeLoraSlots.step` sees the slot's
weights change) and dropped when another takes the slot: one copy per slot, not per adapter
loaded on the host, and none for a step on the base model.
"""

from __future__ import annotations

import ctypes

import numpy as np
import torch

from engine.models.config import ModelConfig
from engine.models.lora import (
    FUSED_TARGETS,
    LoraMatrices,
    LoraSlots,
    LoraWeights,
    target_shapes,
)

__all__ = ["AdapterPanels", "DecodeLoraSlots", "LoraStep"]

_PANEL = 16  # outputs per weight panel, and ranks per panel of A
_PRODUCTS = ("qkv", "o", "gate_up", "down")  # the kernel's order (LoraProductIndex)
_p, _i64 = ctypes.c_void_p, ctypes.c_int64


class _Product(ctypes.Structure):  # TiergateLoraProduct
    _fields_ = [("a", _p), ("a_panels", _i64), ("b", _p), ("b_panels", _p)]


class _Slot(ctypes.Structure):  # TiergateLoraSlot
    _fields_ = [("products", _p), ("h_floats", _i64)]


class LoraStep(ctypes.Structure):  # TiergateLoraStep
    """A step's adapters as the kernel takes them."""

    _fields_ = [("slots", _p), ("num_slots", _i64), ("row_slots", _p), ("h", _p),
                ("h_stride", _i64)]


def _target_widths(config: ModelConfig) -> dict[str, tuple[int, ...]]:
    """Each fused product's targets' output widths, FUSED_TARGETS order."""
    shapes = target_shapes(config)
    return {product: tuple(shapes[name][1] for name in names)
            for product, names in FUSED_TARGETS.items()}


def _a_panels(a_t: torch.Tensor) -> torch.Tensor:  # [in, R] -> [R16 / 16, in, 16]
    """A (given as A^T) in panels of 16 ranks, zero past R: the shrink's layout."""
    num_in, rank = a_t.shape
    padded = a_t.new_zeros(num_in, -(-rank // _PANEL) * _PANEL)
    padded[:, :rank] = a_t
    return padded.view(num_in, -1, _PANEL).transpose(0, 1).contiguous()


def _b_panels(matrices: LoraMatrices, widths: tuple[int, ...], interleaved: bool,
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """B's nonzero blocks by the product's output panels, in the kernel's panel order (gate
    and up interleaved: gate 0, up 0, gate 1, ...), and per panel (its first h row, its rank,
    where its block starts): float32[sum of ranks x 16 per panel], int64[N / 16, 3]."""
    b_t = matrices.b_t
    blocks: list[torch.Tensor] = []  # per target: [its panels, its rank, 16]
    tables: list[np.ndarray] = []  # per target: [its panels, 2] (first h row, rank)
    row = column = 0
    for width, rank in zip(widths, matrices.ranks, strict=True):
        block = b_t[row : row + rank, column : column + width]  # [rank, width]
        blocks.append(block.reshape(rank, width // _PANEL, _PANEL).transpose(0, 1))
        tables.append(np.tile(np.array([row, rank], dtype=np.int64), (width // _PANEL, 1)))
        row += rank
        column += width
    if interleaved:  # two targets of the same width: panel pairs, a row of each per pair
        num_pairs = blocks[0].shape[0]
        data = torch.cat([b.reshape(num_pairs, b.shape[1] * _PANEL) for b in blocks],
                         dim=1).reshape(-1)
        table = np.stack(tables, axis=1).reshape(-1, 2)
    else:
        data = torch.cat([b.reshape(-1) for b in blocks])
        table = np.concatenate(tables)
    starts = np.concatenate([[0], np.cumsum(table[:, 1] * _PANEL)[:-1]]).astype(np.int64)
    full = np.ascontiguousarray(np.concatenate([table, starts[:, None]], axis=1))
    return data.contiguous(), torch.from_numpy(full)


class AdapterPanels:
    """One adapter in the decode kernel's layout: per layer and product its A panels and B
    blocks, and the kernel's struct of its slot."""

    def __init__(self, weights: LoraWeights, config: ModelConfig) -> None:
        widths = _target_widths(config)
        num_layers = len(weights.layers)
        products = (_Product * (num_layers * len(_PRODUCTS)))()
        keep: list[torch.Tensor] = []  # what the structs point into
        h_floats = 0
        for index, layer in enumerate(weights.layers):
            for position, product in enumerate(_PRODUCTS):
                matrices = layer.get(product)
                if matrices is None:
                    continue  # the struct stays null: not targeted
                assert matrices.a_t.dtype == torch.float32 and matrices.a_t.device.type == "cpu"
                assert len(matrices.ranks) == len(FUSED_TARGETS[product])
                a = _a_panels(matrices.a_t)
                b, table = _b_panels(matrices, widths[product], interleaved=product == "gate_up")
                keep += [a, b, table]
                products[index * len(_PRODUCTS) + position] = _Product(
                    a=a.data_ptr(), a_panels=a.shape[0], b=b.data_ptr(),
                    b_panels=table.data_ptr())
                h_floats = max(h_floats, a.shape[0] * _PANEL)
        self._products = products
        self._keep = keep
        self.slot = _Slot(products=ctypes.addressof(products), h_floats=h_floats)
        self.nbytes = sum(t.nbytes for t in keep)


class DecodeLoraSlots:
    """The adapters of a LoraSlots in the kernel's layout, slot by slot, and the step's
    arguments for the kernel (`step`)."""

    def __init__(self, config: ModelConfig, max_rows: int) -> None:
        self.config = config
        self.max_rows = max_rows
        self._made_from: list[LoraWeights | None] = []  # the weights each slot's panels are of
        self._panels: list[AdapterPanels | None] = []
        self._slots = (_Slot * 0)()
        self._h = torch.empty(0, dtype=torch.float32)
        self._step = LoraStep()

    @property
    def nbytes(self) -> int:
        """Bytes of the slots' panels."""
        return sum(p.nbytes for p in self._panels if p is not None)

    def panels(self, slot: int) -> AdapterPanels | None:
        """The slot's adapter in the kernel's layout, as the last step made it."""
        return self._panels[slot]

    def step(self, slots: LoraSlots) -> LoraStep:
        """The kernel's arguments for the step `slots` has bound (active), the panels of a
        slot whose adapter changed made now. Valid until the next call."""
        token_slots = slots.token_slots
        assert token_slots is not None, "no step bound to the slots"
        changed = len(self._panels) != slots.num_slots
        if changed:
            self._made_from = [None] * slots.num_slots
            self._panels = [None] * slots.num_slots
            self._slots = (_Slot * slots.num_slots)()
        for index, weights in enumerate(slots.weights):
            if weights is self._made_from[index]:
                continue
            panels = None if weights is None else AdapterPanels(weights, self.config)
            self._made_from[index], self._panels[index] = weights, panels
            self._slots[index] = _Slot() if panels is None else panels.slot
            changed = True
        step = self._step
        if changed:
            h_stride = max((p.slot.h_floats for p in self._panels if p is not None), default=0)
            if self._h.numel() < self.max_rows * h_stride:
                self._h = torch.empty(self.max_rows * h_stride, dtype=torch.float32)
            step.slots, step.num_slots = ctypes.addressof(self._slots), slots.num_slots
            step.h, step.h_stride = self._h.data_ptr(), h_stride
        step.row_slots = token_slots.ctypes.data
        return step
