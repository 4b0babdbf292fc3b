"""The torch paged attention against a naive dense causal attention per sequence."""

from __future__ import annotations

import functools

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.attention import AttentionMetadata, attention_backend
from engine.attention.cpu_backend import CpuPagedAttention
from engine.attention.torch_paged import (
    GROUP_OVERHEAD,
    MAX_GROUP_BYTES,
    TorchPagedAttention,
    paged_attention,
    plan_attention,
    write_kv,
)
from tests.engine.attention.dense import BLOCK_SIZE, through
from tests.engine.attention.dense import run_case as run_dense_case

run_case = functools.partial(run_dense_case, paged_attention)


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
    metadata = AttentionMetadata.of(tables, torch.arange(len(lens) + 1, dtype=torch.int32),
                                    torch.tensor(lens, dtype=torch.int32))
    plan = plan_attention(metadata, k_cache)
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


def test_the_torch_backend_matches_dense_attention() -> None:
    run_dense_case(through(TorchPagedAttention()), [(20, 1), (44, 9), (70, 1)], sliding_window=30)


def test_backends_plan_once_per_step_and_write_through_the_metadata() -> None:
    """prepare binds a step once; the layers' attends share one plan (a new step, a new one),
    equal to the stateless function, and write_kv writes to the metadata's slots."""
    gen = torch.Generator().manual_seed(3)
    k_cache = torch.randn(8, BLOCK_SIZE, 2, 16, generator=gen)
    v_cache = torch.randn(8, BLOCK_SIZE, 2, 16, generator=gen)
    query = torch.randn(6, 4, 16, generator=gen)
    metadata = AttentionMetadata.of(
        torch.tensor([[1, 4, 0], [2, 5, 7]], dtype=torch.int32),
        torch.tensor([0, 1, 6], dtype=torch.int32),
        torch.tensor([20, 40], dtype=torch.int32),
        slot_mapping=torch.tensor([4 * BLOCK_SIZE + 3, -1, -1, -1, -1, 7 * BLOCK_SIZE + 7]),
    )
    assert not metadata.is_decode_only and metadata.num_seqs == 2
    backend = attention_backend(torch.device("cpu"))
    assert isinstance(backend, CpuPagedAttention)
    for attention in (backend, TorchPagedAttention()):
        attention.prepare(metadata)
        for window in (None, 8):
            expected = paged_attention(query, k_cache, v_cache, metadata, 0.25, window)
            torch.testing.assert_close(attention.attend(query, k_cache, v_cache, 0.25, window),
                                       expected, rtol=1e-5, atol=1e-5)
    torch_backend = TorchPagedAttention()
    torch_backend.prepare(metadata)
    first = torch_backend.plan(k_cache)
    assert torch_backend.plan(k_cache) is first
    torch_backend.prepare(metadata)
    assert torch_backend.plan(k_cache) is not first
    key = torch.ones(6, 2, 16)
    torch_backend.write_kv(key, 2 * key, k_cache, v_cache)
    assert k_cache[4, 3].eq(1).all() and v_cache[7, 7].eq(2).all()
