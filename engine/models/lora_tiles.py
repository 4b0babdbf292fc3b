"""A step's tokens on adapters as the SGMV kernels read them: sorted by slot, cut into tiles.

The Triton LoRA kernels (engine.models.triton_lora) run one program per tile of at most
`block_m` tokens of one slot. The tiles are computed on the host from the slot of each token
(int64[T], -1: the base model) and reach the device in one copy: through `plan_tokens` on an
eager step, or as fields of the static buffers a captured decode graph reads
(engine.worker.graph_inputs). A captured graph launches a fixed grid: `graph_tiles` tiles,
the most a decode batch of that size can make; the tiles past the step's own have no tokens
and their programs return at once. Numpy only: nothing here needs Triton or a GPU.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

__all__ = ["GRAPH_BLOCK_M", "LoraTokenPlan", "graph_tiles", "plan_tokens", "tile_tokens"]

GRAPH_BLOCK_M = 16  # tokens per tile in captured decode graphs (decodes: few tokens a slot)
_MIN_BLOCK_M = 16  # tl.dot needs every dimension >= 16


@dataclass(frozen=True)
class LoraTokenPlan:
    """One step's tokens on adapters, sorted by slot and cut into tiles of one slot (made once
    per step, read by every product of every layer)."""

    num_tokens: int  # T: the step's tokens, base-model ones included
    block_m: int  # tokens per tile
    num_tiles: int  # the kernels' programs along tiles; tiles of no tokens return at once
    order: torch.Tensor  # int32 [>= tokens on adapters]: token indices, grouped by slot
    tile_slot: torch.Tensor  # int32 [num_tiles]
    tile_start: torch.Tensor  # int32 [num_tiles]: the tile's first position in order
    tile_len: torch.Tensor  # int32 [num_tiles]: its tokens, 0..block_m


def tile_tokens(token_slots: np.ndarray, block_m: int | None = None,
                ) -> tuple[np.ndarray, np.ndarray, int]:
    """The tiles of a step whose token t is on slot token_slots[t] (-1: the base model):
    (order int32 [tokens on adapters], tiles int32 [3, num_tiles] of (slot, start, length),
    block_m). block_m: tokens per tile (a power of two >= 16), by default 16, 32 or 64 after
    the largest slot's tokens."""
    slots = np.asarray(token_slots, dtype=np.int64).reshape(-1)
    on = np.flatnonzero(slots >= 0)
    order = on[np.argsort(slots[on], kind="stable")]
    used, first, counts = np.unique(slots[order], return_index=True, return_counts=True)
    if block_m is None:
        largest = int(counts.max()) if counts.size else 0
        block_m = 16 if largest <= 16 else 32 if largest <= 32 else 64
    assert block_m >= _MIN_BLOCK_M and block_m & (block_m - 1) == 0
    tiles = [(slot, start, min(block_m, begin + count - start))
             for slot, begin, count in zip(used.tolist(), first.tolist(), counts.tolist(),
                                           strict=True)
             for start in range(begin, begin + count, block_m)]
    table = np.asarray(tiles, dtype=np.int32).reshape(-1, 3).T
    return order.astype(np.int32), np.ascontiguousarray(table), block_m


def graph_tiles(num_tokens: int, num_slots: int) -> int:
    """The most tiles of GRAPH_BLOCK_M tokens that num_tokens tokens over num_slots slots
    make: every slot's last tile may be partial, and no tile is empty."""
    return min(num_tokens, num_tokens // GRAPH_BLOCK_M + num_slots)


def plan_tokens(token_slots: np.ndarray | torch.Tensor, device: torch.device | str,
                block_m: int | None = None) -> LoraTokenPlan:
    """tile_tokens, copied to device in one copy (a CUDA tensor of slots is first copied to
    the host, a sync: pass the runner's numpy slots)."""
    if isinstance(token_slots, torch.Tensor):
        token_slots = token_slots.detach().cpu().numpy()
    slots = np.asarray(token_slots, dtype=np.int64).reshape(-1)
    order, table, block_m = tile_tokens(slots, block_m)
    packed = torch.from_numpy(np.concatenate([order, table.reshape(-1)])).to(device)
    num_on, num_tiles = order.size, table.shape[1]
    tile_slot, tile_start, tile_len = packed[num_on:].view(3, num_tiles)
    return LoraTokenPlan(int(slots.size), block_m, num_tiles, packed[:num_on], tile_slot,
                         tile_start, tile_len)
