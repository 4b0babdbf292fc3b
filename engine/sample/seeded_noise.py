"""Stateless seeded noise: a seeded request samples the same tokens whatever shares its batch.

A seeded row's noise is a counter-based hash (splitmix64) of (seed, sample_index, number of
outputs so far, token id). `request_key` hashes the first two once per request (Python ints);
`event_keys` adds the output count for each sampling event of a step (numpy's wrapping uint64
arithmetic, the whole batch at once); `seeded_exponential` expands each event's key into one
Exp(1) draw per token on the device, in int64 bit patterns (torch has no uint64 arithmetic).
None keeps state, so the same request gives the same tokens on any device, in any batch, and
across preemption and resumption.
"""

from __future__ import annotations

from typing import TypeVar

import numpy as np
import torch

__all__ = ["event_keys", "request_key", "seeded_exponential"]

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15  # splitmix64 increment
_MIX1 = 0xBF58476D1CE4E5B9
_MIX2 = 0x94D049BB133111EB
_U64 = TypeVar("_U64", int, np.ndarray)  # a Python int below 2**64, or a uint64 array


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


def _mix64(value: _U64) -> _U64:
    """splitmix64's finaliser on a Python int below 2**64 or a uint64 array (the same
    operations: the masks keep a Python int to 64 bits and leave an array's wrapped bits)."""
    value = (value ^ (value >> 30)) * _MIX1 & _MASK64
    value = (value ^ (value >> 27)) * _MIX2 & _MASK64
    return value ^ (value >> 31)


def request_key(seed: int, sample_index: int) -> int:
    """The key of a seeded request's samples (any int seed, taken modulo 2**64), as the int64
    with the same bits: computed once, when the request joins a batch."""
    key = _mix64((seed + _GOLDEN) & _MASK64)
    return _signed64(_mix64(((key ^ sample_index) + _GOLDEN) & _MASK64))


def event_keys(request_keys: np.ndarray, num_output_tokens: np.ndarray) -> np.ndarray:
    """int64[N]: the key of each row's sampling event (request_keys: int64[N] from
    request_key; num_output_tokens: int64[N], its outputs so far); seeded_exponential turns
    a key into the row's noise."""
    keys = request_keys.astype(np.int64).view(np.uint64) ^ num_output_tokens.astype(np.uint64)
    return _mix64(keys + np.uint64(_GOLDEN)).view(np.int64)
