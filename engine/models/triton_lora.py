# mypy: allow-untyped-defs
# (Triton reads kernel annotations as specialisation hints, so @triton.jit functions stay bare.)
"""Triton kernels: one step's LoRA updates of one fused product in two launches (SGMV-style).

`LoraSlots.add` (engine.models.lora) runs one shrink and one expand per slot the step uses;
these kernels run every slot of the step at once, whatever the mix:

- the shrink, h[t] = x[t] @ A_s^T for each token t on slot s (`lora_shrink`);
- the expand, out[t] += h[t] @ B_s, in place (`lora_expand`); base-model tokens (slot -1)
  are neither read nor written.

Stacked layout (`TritonLoraStack`, filled once when an adapter enters a slot): per fused
product, every slot's update sits in buffers of one shape, each of the product's targets
(FUSED_TARGETS order) in a block of RANK_CAP rows, RANK_CAP = max_rank rounded up to a power
of two >= 16, zero-padded past the target's rank:

    a[product]      [num_layers, num_slots, NUM_TARGETS * RANK_CAP, in]   (A, row-major)
    b[product]      [num_layers, num_slots, NUM_TARGETS * RANK_CAP, N]    (B^T, scaling folded)
    ranks[product]  int32 [num_layers, num_slots, NUM_TARGETS]   (0: target or slot absent)
    bounds[product] int32 [NUM_TARGETS + 1]   the targets' first output columns, then N

B^T of a target holds its own columns only (LoraMatrices.b_t is block-diagonal), so the expand
reads, for a tile of output columns, only the rank rows of the targets those columns belong to
and only up to each slot's own rank: no work on the zero blocks nor on the rank padding.

Tokens: the step's tokens on adapters are sorted by slot once per step (engine.models.lora_tiles,
on the host, from the numpy slots the runner binds), and cut into tiles of BLOCK_M tokens of
one slot (a captured decode graph launches a fixed number of tiles: those of no tokens return);
every program of both kernels takes one tile (gathering its rows of x / out by token index), so
its products are tl.dot tiles against a single adapter's weights. Programs: the shrink
(tiles, rank chunks, SPLIT_K), the expand (tiles, column tiles). A long reduction (large `in`,
few tiles: decoding) splits over SPLIT_K programs that write partial sums, h being
float32 [SPLIT_K, T, NUM_TARGETS * RANK_CAP], which the expand adds while it reads h: no atomics,
the result is deterministic. Accumulation is in float32; the expand rounds h to the weights' dtype
for its dot (as the torch path does) and adds its float32 sum to out, rounded once to out's dtype.

The CUDA path of LoraSlots; the tests run it under the Triton interpreter on the CPU.
"""

from __future__ import annotations

import functools
from collections.abc import Mapping

import numpy as np
import torch
import triton
import triton.language as tl

from engine.attention.triton_paged_tile import needs_fp32_dot
from engine.models.config import ModelConfig
from engine.models.lora import FUSED_TARGETS, LoraWeights, target_shapes
from engine.models.lora_tiles import LoraTokenPlan, plan_tokens

__all__ = ["TritonLoraStack", "lora_expand", "lora_shrink", "rank_capacity"]

_MIN_DOT = 16  # tl.dot needs every dimension >= 16
_SHRINK_BLOCK_R = 64  # rank rows per shrink program (at most RANK_CAP)
_EXPAND_BLOCK_R = 16  # rank rows per expand step (the loop stops at the slot's rank)


def rank_capacity(max_rank: int) -> int:
    """Rows a target takes in the stacked layout: max_rank rounded up to a power of two
    >= 16."""
    assert max_rank >= 1
    return max(_MIN_DOT, triton.next_power_of_2(max_rank))


@triton.jit
def _shrink_kernel(
    x_ptr,  # [T, in]
    a_ptr,  # [num_slots, NUM_TARGETS * RANK_CAP, in]
    h_ptr,  # float32 [SPLIT_K, T, NUM_TARGETS * RANK_CAP]
    ranks_ptr,  # int32 [num_slots, NUM_TARGETS]
    order_ptr,  # int32 [tokens on adapters]: token indices sorted by slot
    tile_slot_ptr,  # int32 [num_tiles]
    tile_start_ptr,  # int32 [num_tiles]: the tile's first position in order
    tile_len_ptr,  # int32 [num_tiles]: its tokens, 1..BLOCK_M
    in_features,
    k_per_split,  # columns of x per split, a multiple of BLOCK_K
    stride_xt,
    stride_as,
    stride_ar,
    stride_hs,
    stride_ht,
    NUM_TARGETS: tl.constexpr,
    RANK_CAP: tl.constexpr,  # rank rows per target, a multiple of BLOCK_R
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_K: tl.constexpr,
    UPCAST: tl.constexpr,  # float32 tiles (needs_fp32_dot: the interpreter on bf16)
):
    tile = tl.program_id(0)
    chunk = tl.program_id(1)
    split = tl.program_id(2)
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    start = tl.load(tile_start_ptr + tile)
    count = tl.load(tile_len_ptr + tile)
    target = chunk // (RANK_CAP // BLOCK_R)
    r0 = (chunk % (RANK_CAP // BLOCK_R)) * BLOCK_R
    rank = tl.load(ranks_ptr + slot * NUM_TARGETS + target)
    # A chunk past the slot's rank of the target writes nothing: the expand never reads it;
    # nor does a tile of no tokens (past a captured graph's step's own tiles).
    if (r0 < rank) & (count > 0):
        offs_m = tl.arange(0, BLOCK_M)
        m_mask = offs_m < count
        tokens = tl.load(order_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
        offs_r = r0 + tl.arange(0, BLOCK_R)
        r_mask = offs_r < rank
        rows = target * RANK_CAP + offs_r
        a_base = a_ptr + slot * stride_as + rows[None, :] * stride_ar
        acc = tl.zeros([BLOCK_M, BLOCK_R], dtype=tl.float32)
        k_lo = split * k_per_split
        k_hi = tl.minimum(k_lo + k_per_split, in_features)
        # An empty split (k_lo >= in) still stores its zeros: the expand adds every split.
        for k0 in range(k_lo, k_hi, BLOCK_K):
            offs_k = k0 + tl.arange(0, BLOCK_K)
            k_mask = offs_k < k_hi
            xt = tl.load(x_ptr + tokens[:, None] * stride_xt + offs_k[None, :],
                         mask=m_mask[:, None] & k_mask[None, :], other=0.0)
            at = tl.load(a_base + offs_k[:, None], mask=k_mask[:, None] & r_mask[None, :],
                         other=0.0)  # [BLOCK_K, BLOCK_R]: A^T
            if UPCAST:
                xt = xt.to(tl.float32)
                at = at.to(tl.float32)
            else:
                at = at.to(xt.dtype)
            acc += tl.dot(xt, at, input_precision="ieee")
        tl.store(h_ptr + split * stride_hs + tokens[:, None] * stride_ht + rows[None, :], acc,
                 mask=m_mask[:, None])


@triton.jit
def _expand_kernel(
    h_ptr,  # float32 [SPLIT_K, T, NUM_TARGETS * RANK_CAP]
    b_ptr,  # [num_slots, NUM_TARGETS * RANK_CAP, N]
    out_ptr,  # [T, N], updated in place
    ranks_ptr,  # int32 [num_slots, NUM_TARGETS]
    bounds_ptr,  # int32 [NUM_TARGETS + 1]: each target's first column, then N
    order_ptr,
    tile_slot_ptr,
    tile_start_ptr,
    tile_len_ptr,
    n_features,
    stride_hs,
    stride_ht,
    stride_bs,
    stride_br,
    stride_ot,
    NUM_TARGETS: tl.constexpr,
    RANK_CAP: tl.constexpr,
    SPLIT_K: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_R: tl.constexpr,
    BLOCK_N: tl.constexpr,
    UPCAST: tl.constexpr,
):
    tile = tl.program_id(0)
    n_lo = tl.program_id(1) * BLOCK_N
    slot = tl.load(tile_slot_ptr + tile).to(tl.int64)
    start = tl.load(tile_start_ptr + tile)
    count = tl.load(tile_len_ptr + tile)
    offs_m = tl.arange(0, BLOCK_M)
    m_mask = offs_m < count
    tokens = tl.load(order_ptr + start + offs_m, mask=m_mask, other=0).to(tl.int64)
    offs_n = n_lo + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_features
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for target in tl.static_range(NUM_TARGETS):
        rank = tl.load(ranks_ptr + slot * NUM_TARGETS + target)
        first = tl.load(bounds_ptr + target)
        end = tl.load(bounds_ptr + target + 1)
        # B^T of the target is zero outside its columns: skip it unless the tile meets them
        # (and a tile of no tokens reads no weights).
        rank = tl.where((n_lo < end) & (n_lo + BLOCK_N > first) & (count > 0), rank, 0)
        for r0 in range(0, rank, BLOCK_R):
            offs_r = r0 + tl.arange(0, BLOCK_R)
            r_mask = offs_r < rank
            rows = target * RANK_CAP + offs_r
            h_ptrs = h_ptr + tokens[:, None] * stride_ht + rows[None, :]
            h_mask = m_mask[:, None] & r_mask[None, :]
            ht = tl.load(h_ptrs, mask=h_mask, other=0.0)
            for split in tl.static_range(1, SPLIT_K):
                ht += tl.load(h_ptrs + split * stride_hs, mask=h_mask, other=0.0)
            bt = tl.load(b_ptr + slot * stride_bs + rows[:, None] * stride_br + offs_n[None, :],
                         mask=r_mask[:, None] & n_mask[None, :], other=0.0)
            # h rounded to the weights' dtype, as x @ a_t is in the torch path.
            ht = ht.to(b_ptr.dtype.element_ty)
            if UPCAST:
                ht = ht.to(tl.float32)
                bt = bt.to(tl.float32)
            acc += tl.dot(ht, bt, input_precision="ieee")
    o_ptrs = out_ptr + tokens[:, None] * stride_ot + offs_n[None, :]
    o_mask = m_mask[:, None] & n_mask[None, :]
    current = tl.load(o_ptrs, mask=o_mask, other=0.0).to(tl.float32)
    tl.store(o_ptrs, (current + acc).to(out_ptr.dtype.element_ty), mask=o_mask)


def _as_plan(token_slots: LoraTokenPlan | np.ndarray | torch.Tensor,
             device: torch.device) -> LoraTokenPlan:
    if isinstance(token_slots, LoraTokenPlan):
        return token_slots
    return plan_tokens(token_slots, device)


@functools.cache
def _multiprocessors(device: torch.device) -> int:
    return int(torch.cuda.get_device_properties(device).multi_processor_count)


def _default_split_k(x: torch.Tensor, programs: int, block_k: int) -> int:
    """Splits of the shrink's reduction: on a GPU, enough programs for its multiprocessors
    while each split keeps 4 blocks of `in` or more; 1 elsewhere."""
    if not x.is_cuda:
        return 1
    sms = _multiprocessors(x.device)
    blocks = triton.cdiv(x.shape[1], block_k)
    split = 1
    while split < 8 and programs * split * 2 <= sms and blocks >= split * 2 * 4:
        split *= 2
    return split


def lora_shrink(
    x: torch.Tensor,
    a_stack: torch.Tensor,
    token_slots: LoraTokenPlan | np.ndarray | torch.Tensor,
    ranks: torch.Tensor,
    *,
    split_k: int | None = None,
    block_k: int = 64,
) -> torch.Tensor:
    """h = x @ A_s^T per token on slot s, of x [T, in], a_stack [num_slots, NT * RANK_CAP, in]
    and ranks int32 [num_slots, NT] (each target's block of RANK_CAP rows, its first
    ranks[s, t] rows used). Returns float32 h [SPLIT_K, T, NT * RANK_CAP], partial sums over
    splits of `in` (h.sum(0) is the product): only the rows of tokens on a slot and each
    target's first ranks[s, t] columns are written (read them through lora_expand)."""
    plan = _as_plan(token_slots, x.device)
    num_slots, rank_rows, in_features = a_stack.shape
    num_targets = ranks.shape[1]
    rank_cap = rank_rows // num_targets
    assert x.dim() == 2 and x.shape == (plan.num_tokens, in_features) and x.stride(1) == 1
    assert a_stack.stride(2) == 1 and ranks.shape == (num_slots, num_targets)
    assert ranks.dtype == torch.int32 and ranks.is_contiguous()
    assert rank_cap * num_targets == rank_rows and rank_cap >= _MIN_DOT
    block_r = min(rank_cap, _SHRINK_BLOCK_R)
    assert rank_cap % block_r == 0
    block_k = max(_MIN_DOT, min(block_k, triton.next_power_of_2(in_features)))
    chunks = rank_rows // block_r
    if split_k is None:
        split_k = _default_split_k(x, plan.num_tiles * chunks, block_k)
    k_per_split = triton.cdiv(triton.cdiv(in_features, block_k), split_k) * block_k
    h = torch.empty(split_k, plan.num_tokens, rank_rows, dtype=torch.float32, device=x.device)
    if plan.num_tiles:
        _shrink_kernel[(plan.num_tiles, chunks, split_k)](
            x, a_stack, h, ranks, plan.order, plan.tile_slot, plan.tile_start, plan.tile_len,
            in_features, k_per_split, x.stride(0), a_stack.stride(0), a_stack.stride(1),
            h.stride(0), h.stride(1),
            NUM_TARGETS=num_targets, RANK_CAP=rank_cap, BLOCK_M=plan.block_m, BLOCK_R=block_r,
            BLOCK_K=block_k, UPCAST=needs_fp32_dot(x.dtype) or needs_fp32_dot(a_stack.dtype),
        )
    return h


def lora_expand(
    h: torch.Tensor,
    b_stack: torch.Tensor,
    token_slots: LoraTokenPlan | np.ndarray | torch.Tensor,
    ranks: torch.Tensor,
    out: torch.Tensor,
    bounds: torch.Tensor | None = None,
    *,
    block_n: int = 64,
) -> None:
    """out[t] += h[t] @ B_s (in place) per token on slot s, of h from lora_shrink,
    b_stack [num_slots, NT * RANK_CAP, N] (B^T, target blocks as a_stack's) and out [T, N];
    bounds: int32 [NT + 1], each target's first column of out, then N (None: every target may
    write every column). Base-model tokens' rows of out are not touched."""
    plan = _as_plan(token_slots, out.device)
    split_k, num_tokens, rank_rows = h.shape
    num_slots, _, n_features = b_stack.shape
    num_targets = ranks.shape[1]
    rank_cap = rank_rows // num_targets
    assert h.dtype == torch.float32 and h.stride(2) == 1 and num_tokens == plan.num_tokens
    assert b_stack.shape[1] == rank_rows and b_stack.stride(2) == 1
    assert ranks.shape == (num_slots, num_targets) and ranks.dtype == torch.int32
    assert ranks.is_contiguous() and rank_cap % _EXPAND_BLOCK_R == 0
    assert out.dim() == 2 and out.shape == (num_tokens, n_features) and out.stride(1) == 1
    if bounds is None:
        bounds = torch.tensor([0] * num_targets + [n_features], dtype=torch.int32,
                              device=out.device)
    assert bounds.shape == (num_targets + 1,) and bounds.dtype == torch.int32
    block_n = max(_MIN_DOT, min(block_n, triton.next_power_of_2(n_features)))
    if plan.num_tiles:
        _expand_kernel[(plan.num_tiles, triton.cdiv(n_features, block_n))](
            h, b_stack, out, ranks, bounds, plan.order, plan.tile_slot, plan.tile_start,
            plan.tile_len, n_features, h.stride(0), h.stride(1), b_stack.stride(0),
            b_stack.stride(1), out.stride(0),
            NUM_TARGETS=num_targets, RANK_CAP=rank_cap, SPLIT_K=split_k, BLOCK_M=plan.block_m,
            BLOCK_R=_EXPAND_BLOCK_R, BLOCK_N=block_n, UPCAST=needs_fp32_dot(b_stack.dtype),
        )


class TritonLoraStack:
    """Every slot's adapter in the stacked layout (module docstring), on the device: what the
    two kernels read. `set_slot` when an adapter enters (or leaves) a slot; per step
    `plan_tokens` once, then `apply` per layer and product."""

    def __init__(
        self,
        shapes: Mapping[str, tuple[int, int]],
        num_layers: int,
        num_slots: int,
        max_rank: int,
        dtype: torch.dtype,
        device: torch.device | str,
    ) -> None:
        """shapes: (in, out) features of each HF module (engine.models.lora.target_shapes)."""
        self.device = torch.device(device)
        self.dtype = dtype
        self.num_layers, self.num_slots = num_layers, num_slots
        self.rank_cap = rank_capacity(max_rank)
        self.a: dict[str, torch.Tensor] = {}
        self.b: dict[str, torch.Tensor] = {}
        self.ranks: dict[str, torch.Tensor] = {}
        self.bounds: dict[str, torch.Tensor] = {}
        self._columns: dict[str, list[tuple[int, int]]] = {}  # per target (first, width)
        for product, names in FUSED_TARGETS.items():
            in_features = shapes[names[0]][0]
            widths = [shapes[name][1] for name in names]
            starts = np.cumsum([0, *widths]).tolist()
            rows = len(names) * self.rank_cap
            self.a[product] = torch.zeros(num_layers, num_slots, rows, in_features,
                                          dtype=dtype, device=self.device)
            self.b[product] = torch.zeros(num_layers, num_slots, rows, starts[-1], dtype=dtype,
                                          device=self.device)
            self.ranks[product] = torch.zeros(num_layers, num_slots, len(names),
                                              dtype=torch.int32, device=self.device)
            self.bounds[product] = torch.tensor(starts, dtype=torch.int32, device=self.device)
            self._columns[product] = list(zip(starts[:-1], widths, strict=True))

    @classmethod
    def for_model(cls, config: ModelConfig, num_slots: int, max_rank: int, dtype: torch.dtype,
                  device: torch.device | str) -> TritonLoraStack:
        return cls(target_shapes(config), config.num_layers, num_slots, max_rank, dtype, device)

    def set_slot(self, slot: int, weights: LoraWeights | None) -> None:
        """Copy an adapter (LoraWeights in the decoder's fused layout) into slot; None empties
        the slot. Each target's rank must be at most max_rank."""
        assert 0 <= slot < self.num_slots
        ranks: dict[str, np.ndarray] = {}
        for product in FUSED_TARGETS:
            self.a[product][:, slot].zero_()
            self.b[product][:, slot].zero_()
            ranks[product] = np.zeros((self.num_layers, len(FUSED_TARGETS[product])), np.int32)
        if weights is not None:
            assert len(weights.layers) == self.num_layers
            for layer, products in enumerate(weights.layers):
                for product, matrices in products.items():
                    a, b = self.a[product][layer, slot], self.b[product][layer, slot]
                    row = 0
                    for target, rank in enumerate(matrices.ranks):
                        assert rank <= self.rank_cap, f"rank {rank} over {self.rank_cap}"
                        if not rank:
                            continue
                        first, width = self._columns[product][target]
                        block = target * self.rank_cap
                        a[block : block + rank].copy_(matrices.a_t[:, row : row + rank].t())
                        b[block : block + rank, first : first + width].copy_(
                            matrices.b_t[row : row + rank, first : first + width])
                        row += rank
                    ranks[product][layer] = matrices.ranks
        for product, values in ranks.items():
            self.ranks[product][:, slot].copy_(torch.from_numpy(values))

    def plan(self, token_slots: np.ndarray) -> LoraTokenPlan:
        """The step's tiles (engine.models.lora.SlotKernels): plan_tokens on this device."""
        return plan_tokens(token_slots, self.device)

    def apply(
        self,
        layer: int,
        product: str,
        x: torch.Tensor,
        out: torch.Tensor,
        token_slots: LoraTokenPlan | np.ndarray | torch.Tensor,
        *,
        split_k: int | None = None,
    ) -> None:
        """out += each token's adapter update of `product` in `layer` (x [T, in], out [T, N];
        token_slots: the step's plan_tokens, or its slots int64[T], -1: the base model)."""
        plan = _as_plan(token_slots, self.device)
        ranks = self.ranks[product][layer]
        h = lora_shrink(x, self.a[product][layer], plan, ranks, split_k=split_k)
        lora_expand(h, self.b[product][layer], plan, ranks, out, self.bounds[product])
