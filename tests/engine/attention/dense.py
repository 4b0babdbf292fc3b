"""Checking a paged attention implementation against naive dense causal attention.

`run_case` lays random sequences out in a paged cache over shuffled blocks (garbage in every
slot nobody wrote), runs the implementation under test, and compares every row with dense
attention of that sequence computed in float64.
"""

from __future__ import annotations

import random
from collections.abc import Callable

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.attention.torch_paged import write_kv

BLOCK_SIZE = 16

# (query, k_cache, v_cache, metadata, scale, sliding_window)
PagedAttentionFn = Callable[
    [torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata, float, int | None],
    torch.Tensor,
]


def through(backend: AttentionBackend) -> PagedAttentionFn:
    """A backend as a function: bind the case's metadata, then attend."""

    def attend(query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               metadata: AttentionMetadata, scale: float, sliding_window: int | None
               ) -> torch.Tensor:
        backend.prepare(metadata)
        return backend.attend(query, k_cache, v_cache, scale, sliding_window)

    return attend


def dense_attention(
    query: torch.Tensor,  # [n, H, D]: the last n tokens of the context
    keys: torch.Tensor,  # [ctx, Hkv, D]
    values: torch.Tensor,  # [ctx, Hkv, D]
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [n, H, D]
    """Causal attention of one sequence, in float64 on the query's device, returned in the
    query's dtype: the reference every paged implementation is checked against."""
    n, num_heads, _ = query.shape
    ctx, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1).double()  # [H, ctx, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1).double()
    scores = torch.matmul(query.transpose(0, 1).double(), k.transpose(1, 2)) * scale  # [H, n, ctx]
    row = torch.arange(ctx - n, ctx, device=query.device)[:, None]
    col = torch.arange(ctx, device=query.device)[None, :]
    visible = col <= row
    if sliding_window is not None:
        visible &= col > row - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(scores.softmax(-1), v).transpose(0, 1).to(query.dtype)


def run_case(
    attend: PagedAttentionFn,
    seqs: list[tuple[int, int]],  # (context_len, q_len) per sequence, in row order
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    sliding_window: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
    strided_query: bool = False,  # queries as a view into a wider fused qkv row
) -> None:
    gen = torch.Generator().manual_seed(seed)
    rng = random.Random(seed)
    num_blocks = sum(-(-ctx // BLOCK_SIZE) for ctx, _ in seqs) + 3
    free = list(range(num_blocks))
    rng.shuffle(free)
    shape = (num_blocks, BLOCK_SIZE, num_kv_heads, head_dim)
    k_cache = torch.randn(shape, generator=gen).to(dtype)  # garbage outside written slots
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    tables, queries, expected = [], [], []
    max_blocks = max(-(-ctx // BLOCK_SIZE) for ctx, _ in seqs) + 1
    for ctx, q_len in seqs:
        table = [free.pop() for _ in range(-(-ctx // BLOCK_SIZE))]
        keys = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        values = torch.randn(ctx, num_kv_heads, head_dim, generator=gen).to(dtype)
        slots = torch.tensor([table[p // BLOCK_SIZE] * BLOCK_SIZE + p % BLOCK_SIZE
                              for p in range(ctx)])
        write_kv(keys, values, k_cache, v_cache, slots)
        query = torch.randn(q_len, num_heads, head_dim, generator=gen).to(dtype)
        expected.append(dense_attention(query, keys, values, head_dim**-0.5, sliding_window))
        queries.append(query)
        tables.append(table + [0] * (max_blocks - len(table)))
    starts = [0]
    for _, q_len in seqs:
        starts.append(starts[-1] + q_len)
    query = torch.cat(queries)
    if strided_query:
        fused = torch.randn(query.shape[0], num_heads + 2 * num_kv_heads, head_dim,
                            generator=gen).to(dtype)
        fused[:, :num_heads] = query
        query = fused[:, :num_heads]
    metadata = AttentionMetadata.of(
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32),
    )
    out = attend(query, k_cache, v_cache, metadata, head_dim**-0.5, sliding_window)
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, torch.cat(expected), rtol=tolerance, atol=tolerance)
