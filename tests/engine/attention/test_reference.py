"""The torch paged attention against a naive dense causal attention per sequence."""

from __future__ import annotations

import random

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.attention import PagedAttention, paged_attention, write_kv
from engine.attention.reference import (
    GROUP_OVERHEAD,
    MAX_GROUP_BYTES,
    plan_attention,
)

BLOCK_SIZE = 16


def dense_attention(
    query: torch.Tensor,  # [n, H, D]: the last n tokens of the context
    keys: torch.Tensor,  # [ctx, Hkv, D]
    values: torch.Tensor,  # [ctx, Hkv, D]
    scale: float,
    sliding_window: int | None,
) -> torch.Tensor:  # [n, H, D]
    n, num_heads, _ = query.shape
    ctx, num_kv_heads, _ = keys.shape
    group = num_heads // num_kv_heads
    k = keys.repeat_interleave(group, dim=1).transpose(0, 1).double()  # [H, ctx, D]
    v = values.repeat_interleave(group, dim=1).transpose(0, 1).double()
    scores = torch.matmul(query.transpose(0, 1).double(), k.transpose(1, 2)) * scale  # [H, n, ctx]
    row = torch.arange(ctx - n, ctx)[:, None]
    col = torch.arange(ctx)[None, :]
    visible = col <= row
    if sliding_window is not None:
        visible &= col > row - sliding_window
    scores = scores.masked_fill(~visible, float("-inf"))
    return torch.matmul(scores.softmax(-1), v).transpose(0, 1).to(query.dtype)


def run_case(
    seqs: list[tuple[int, int]],  # (context_len, q_len) per sequence, in row order
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    sliding_window: int | None = None,
    dtype: torch.dtype = torch.float32,
    seed: int = 0,
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
    out = paged_attention(
        torch.cat(queries),
        k_cache,
        v_cache,
        torch.tensor(tables, dtype=torch.int32),
        torch.tensor(starts, dtype=torch.int32),
        torch.tensor([ctx for ctx, _ in seqs], dtype=torch.int32),
        head_dim**-0.5,
        sliding_window,
    )
    tolerance = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out, torch.cat(expected), rtol=tolerance, atol=tolerance)


def test_decodes() -> None:
    run_case([(1, 1), (17, 1), (16, 1), (40, 1), (3, 1)])


def test_prefill_without_prefix() -> None:
    run_case([(37, 37), (5, 5)])


def test_prefill_over_cached_prefix() -> None:
    run_case([(50, 18), (33, 2), (16, 16)])


def test_mixed_batch_in_any_row_order() -> None:
    # Decodes between prefill chunks: the decode group's rows are not contiguous.
    run_case([(20, 1), (44, 9), (70, 1), (12, 12), (9, 1)])


@pytest.mark.parametrize("heads", [(4, 4), (4, 1), (8, 2)])
def test_head_layouts(heads: tuple[int, int]) -> None:
    run_case([(30, 1), (25, 7), (64, 64)], num_heads=heads[0], num_kv_heads=heads[1])


@pytest.mark.parametrize("window", [1, 5, 16, 100])
def test_sliding_window(window: int) -> None:
    run_case([(40, 1), (3, 1), (50, 13), (24, 24)], sliding_window=window)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_half_precision(dtype: torch.dtype) -> None:
    run_case([(30, 1), (25, 7)], dtype=dtype)


@settings(max_examples=40, deadline=None)
@given(
    seqs=st.lists(
        st.integers(1, 90).flatmap(lambda ctx: st.tuples(st.just(ctx), st.integers(1, ctx))),
        min_size=1,
        max_size=6,
    ),
    window=st.one_of(st.none(), st.integers(1, 40)),
    seed=st.integers(0, 1000),
)
def test_random_batches(seqs: list[tuple[int, int]], window: int | None, seed: int) -> None:
    run_case(seqs, sliding_window=window, seed=seed)


def test_write_kv_skips_negative_slots() -> None:
    k_cache = torch.zeros(2, BLOCK_SIZE, 1, 4)
    v_cache = torch.zeros(2, BLOCK_SIZE, 1, 4)
    key = torch.ones(3, 1, 4)
    write_kv(key, 2 * key, k_cache, v_cache, torch.tensor([17, -1, 3]))
    assert k_cache.view(-1, 4)[[17, 3]].eq(1).all() and v_cache.view(-1, 4)[[17, 3]].eq(2).all()
    assert k_cache.sum() == 8 and v_cache.sum() == 16


def _plan_groups(lens: list[int], k_cache: torch.Tensor) -> list[tuple[int, int]]:
    """(num_seqs, num_blocks) of each decode group the plan makes for decodes of lens."""
    tables = torch.zeros(len(lens), 200, dtype=torch.int32)
    plan = plan_attention(tables, torch.arange(len(lens) + 1, dtype=torch.int32),
                          torch.tensor(lens, dtype=torch.int32), k_cache)
    return sorted((g.num_seqs, g.num_blocks) for g in plan.decode_groups)


def test_decodes_of_very_different_lengths_are_grouped() -> None:
    k_cache = torch.zeros(1, BLOCK_SIZE, 1, 2)  # tiny rows: the byte cap plays no part
    assert GROUP_OVERHEAD < 3 * (2000 - 16)  # splitting pays off here
    assert _plan_groups([10, 12, 11, 2000, 2010], k_cache) == [(2, 126), (3, 1)]
    assert _plan_groups([10, 12, 11], k_cache) == [(3, 1)]


def test_decode_groups_stay_within_the_byte_cap() -> None:
    k_cache = torch.zeros(1, BLOCK_SIZE, 2, 64)  # 1 KiB of K+V per token
    lens = [300] * 10 + [3000]
    max_pairs = MAX_GROUP_BYTES // 1024
    groups = _plan_groups(lens, k_cache)
    assert sum(n for n, _ in groups) == len(lens)
    assert (1, 188) in groups  # a lone sequence may exceed the cap
    assert all(n * blocks * BLOCK_SIZE <= max_pairs for n, blocks in groups if n > 1)


def test_paged_attention_object_reuses_one_plan_per_step() -> None:
    """PagedAttention.prepare binds the batch once; attend equals the stateless function."""
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(8, BLOCK_SIZE, 2, 16, generator=gen)
    v_cache = torch.randn(8, BLOCK_SIZE, 2, 16, generator=gen)
    query = torch.randn(6, 4, 16, generator=gen)
    layout = (
        torch.tensor([[1, 4, 0], [2, 5, 7]], dtype=torch.int32),
        torch.tensor([0, 1, 6], dtype=torch.int32),
        torch.tensor([20, 40], dtype=torch.int32),
    )
    attention = PagedAttention(torch.device("cpu"))
    attention.prepare(*layout)
    for window in (None, 8):
        expected = paged_attention(query, k_cache, v_cache, *layout, 0.25, window)
        torch.testing.assert_close(attention.attend(query, k_cache, v_cache, 0.25, window),
                                   expected, rtol=0, atol=0)
