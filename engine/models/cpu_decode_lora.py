"""LoRA adapters in the layout of the CPU kernels (cpu_decode.cpp's TiergateLora* structs).

The kernels add each row's adapter update, BGMV style: a shrink h = A x for each row on an
adapter (A in panels of 16 ranks, [R16 / 16][in][16], zero rows past the rank), then, in each
thread's share of the product's output panels, out[panel] += B[panel] h. B is block-diagonal
over a fused product's targets (q, k, v; gate, up), so each output panel keeps only its
target's block, [rank][16], and where that target's rows of h start: no multiply-adds over the
zero blocks, none for a target the adapter lacks. The decode forward runs them inside its own
products; the steps that go layer by layer (prefills, mixed steps) call them once per adapted
product (`CpuLoraKernels.apply`), in place of torch's grouped products, whose row gathers and
scatters and zero blocks cost a 2,048-token prefill on 8 adapters more than half again its
base time (ops/bench/journal.md, "LoRA prefills in the C++ kernels").

The layout is a second copy of an adapter (about its size: A padded to 16 ranks, B without
its zero blocks), made when the adapter enters a slot (`CpuLoraKernels.set_slot`) and dropped
when another takes the slot: one copy per slot, not per adapter loaded on the host, and none
for a step on the base model.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
import torch

from engine.models.config import ModelConfig
from engine.models.lora import (
    FUSED_TARGETS,
    LoraMatrices,
    LoraWeights,
    target_shapes,
)

__all__ = ["AdapterPanels", "CpuLoraKernels", "LoraStep"]

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


def _product_inputs(config: ModelConfig) -> dict[str, int]:
    """Each fused product's input width."""
    shapes = target_shapes(config)
    return {product: shapes[names[0]][0] for product, names in FUSED_TARGETS.items()}


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


class CpuLoraKernels:
    """The slots' adapters in the kernels' layout, and the kernels that apply them: the decode
    forward's (it takes a step's `plan`) and `tiergate_lora_update_f32` for the products of the
    steps that go layer by layer (`apply`). engine.models.lora.SlotKernels on the CPU."""

    def __init__(self, config: ModelConfig, num_slots: int, library: ctypes.CDLL) -> None:
        """library: cpu_decode.cpp's, built (engine.models.cpu_decode.lora_kernels)."""
        self.config = config
        self._library = library
        self._widths = {product: (num_in, sum(_target_widths(config)[product]))
                        for product, num_in in _product_inputs(config).items()}
        self._panels: list[AdapterPanels | None] = [None] * num_slots
        self._slots = (_Slot * num_slots)()
        self._h = torch.empty(0, dtype=torch.float32)  # the shrinks' output, grown to a step
        self._h_stride = 0
        self._step = LoraStep(slots=ctypes.addressof(self._slots), num_slots=num_slots)
        self._planned_rows = 0

    @property
    def nbytes(self) -> int:
        """Bytes of the slots' panels."""
        return sum(p.nbytes for p in self._panels if p is not None)

    def panels(self, slot: int) -> AdapterPanels | None:
        """The slot's adapter in the kernels' layout."""
        return self._panels[slot]

    def set_slot(self, slot: int, weights: LoraWeights | None) -> None:
        """An adapter enters slot (None: it is emptied): packed now, the slot's old panels
        dropped."""
        panels = None if weights is None else AdapterPanels(weights, self.config)
        self._panels[slot] = panels
        self._slots[slot] = _Slot() if panels is None else panels.slot
        self._h_stride = max((p.slot.h_floats for p in self._panels if p is not None),
                             default=0)

    def plan(self, token_slots: np.ndarray) -> LoraStep:
        """The kernels' arguments for a step of these tokens' slots (int64[T], -1: the base
        model; kept alive by the caller, LoraSlots): valid until the next plan."""
        rows = len(token_slots)
        if self._h.numel() < rows * self._h_stride:
            self._h = torch.empty(rows * self._h_stride, dtype=torch.float32)
        step = self._step
        step.h, step.h_stride = self._h.data_ptr(), self._h_stride
        step.row_slots = token_slots.ctypes.data
        self._planned_rows = rows
        return step

    def apply(self, layer: int, product: str, x: torch.Tensor, out: torch.Tensor,
              plan: Any) -> None:
        """out += each row's adapter update of `product` in `layer` (x [T, in], out [T, N],
        float32, the T of the plan's step), in one call."""
        num_in, num_out = self._widths[product]
        rows = self._planned_rows
        if not (plan is self._step and 0 <= layer < self.config.num_layers
                and x.shape == (rows, num_in) and out.shape == (rows, num_out)
                and x.dtype == out.dtype == torch.float32 and out.is_contiguous()):
            raise ValueError(f"LoRA update of {product}: inputs do not match the planned step")
        x = x.contiguous()
        split = num_out // 2 if product == "gate_up" else 0
        status = self._library.tiergate_lora_update_f32(
            ctypes.byref(plan), rows, layer, _PRODUCTS.index(product), x.data_ptr(), num_in,
            out.data_ptr(), num_out, split, torch.get_num_threads())
        if status != 0:
            raise ValueError("LoRA update out of range: a row's adapter slot is neither -1 nor "
                             "a slot that holds an adapter")
