"""Stateless seeded noise: a seeded request samples the same tokens whatever shares its batch.

A seeded row's noise is a counter-based hash (splitmix64) of (seed, sample_index, number of
outputs so far, token id): `derive_seeds` makes one key per sampling event on the host, with
numpy's wrapping uint64 arithmetic, and `seeded_exponential` expands each key into one Exp(1)
draw per token on the device, in int64 bit patterns (torch has no uint64 arithmetic). Neither
keeps state, so the same request gives the same tokens on any device, in any batch, and across
preemption and resumption.
"""

from __future__ import annotations

import numpy as np
import torch

__all__ = ["derive_seeds", "seeded_exponential"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64 increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB


def _signed64(value: int) -> int:
    """An unsigned 64-bit value as the int64 with the same bits (torch has no uint64 math)."""
    value &= _MASK64
    return value - (1 << 64) if value >= 1 << 63 else value


def _shift_right(x: torch.Tensor, bits: int) -> torch.Tensor:
    """Logical right shift of int64 bit patterns (torch's >> is arithmetic)."""
    return (x >> bits) & ((1 << (64 - bits)) - 1)


def seeded_exponential(keys: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [R, V] where element (r, v) depends only on (keys[r], v).

    Element v of row r is output v of a splitmix64 stream started at keys[r]; int64 products
    wrap around as unsigned arithmetic would. The top 24 bits make a uniform in (0, 1),
    computed in float64: in float32 the top value (1 - 2**-25) rounds to 1.0, whose noise
    is 0, and p / 0 then picked a token whatever its probability (a NaN for a token
    filtered or masked to p = 0, which argmax takes: about 0.3 % of seeded steps at a
    49,152-token vocabulary sampled a token the grammar or top-k had excluded).
    """
    # keys: int64[R]
    offsets = torch.arange(1, vocab_size + 1, device=keys.device, dtype=torch.int64)
    z = keys[:, None] + offsets[None, :] * _signed64(_GOLDEN)  # [R, V]
    z = (z ^ _shift_right(z, 30)) * _signed64(_MIX1)
    z = (z ^ _shift_right(z, 27)) * _signed64(_MIX2)
    z = z ^ _shift_right(z, 31)
    uniform = (_shift_right(z, 40).to(torch.float64) + 0.5) * (1.0 / (1 << 24))
    return (-torch.log(uniform)).to(torch.float32)


def _mix64(value: np.ndarray) -> np.ndarray:
    """splitmix64 finaliser on uint64 arrays (products wrap modulo 2**64)."""
    value = (value ^ (value >> np.uint64(30))) * np.uint64(_MIX1)
    value = (value ^ (value >> np.uint64(27))) * np.uint64(_MIX2)
    return value ^ (value >> np.uint64(31))


def derive_seeds(
    seeds: np.ndarray, sample_indices: np.ndarray, num_output_tokens: np.ndarray
) -> np.ndarray:
    """int64[N]: the key of one sampling event of each seeded row (seeds: int64 bit patterns);
    seeded_exponential turns a key into the row's noise."""
    golden = np.uint64(_GOLDEN)
    with np.errstate(over="ignore"):
        key = _mix64(seeds.astype(np.int64).view(np.uint64) + golden)
        key = _mix64((key ^ sample_indices.astype(np.uint64)) + golden)
        key = _mix64((key ^ num_output_tokens.astype(np.uint64)) + golden)
    return key.view(np.int64)
