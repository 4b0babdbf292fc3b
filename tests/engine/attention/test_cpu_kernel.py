"""The CPU attention kernel and the CPU backend against dense attention and the PyTorch path."""

from __future__ import annotations

import functools
from pathlib import Path

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine.attention import AttentionMetadata, cpp_build, cpu_backend, cpu_kernel, torch_paged
from engine.attention.cpu_backend import CpuPagedAttention
from tests.engine.attention.dense import BLOCK_SIZE, run_case, through

# Every test here needs the compiled kernel: a machine that cannot build it fails loudly
# instead of skipping (CI has g++; the backend's fallback is covered by test_torch_paged).
kernel_case = functools.partial(run_case, cpu_kernel.paged_attention)
backend_case = functools.partial(run_case, through(CpuPagedAttention()))


def test_kernel_builds_and_loads() -> None:
    assert cpu_kernel.load() is not None


def test_decodes() -> None:
    kernel_case([(1, 1), (17, 1), (16, 1), (40, 1), (3, 1), (300, 1)])


def test_prefills_with_and_without_prefix() -> None:
    kernel_case([(37, 37), (5, 5), (50, 18), (33, 2), (16, 16)])


@pytest.mark.parametrize("heads", [(4, 4), (4, 1), (8, 2), (8, 4)])
def test_head_layouts(heads: tuple[int, int]) -> None:
    kernel_case([(30, 1), (25, 7), (64, 64)], num_heads=heads[0], num_kv_heads=heads[1],
                head_dim=64)


@pytest.mark.parametrize("window", [1, 5, 16, 100])
def test_sliding_window(window: int) -> None:
    kernel_case([(40, 1), (3, 1), (50, 13), (24, 24)], sliding_window=window)


def test_strided_query_rows() -> None:
    """The model hands over q as a view into the fused qkv projection."""
    kernel_case([(20, 1), (44, 9), (70, 1)], strided_query=True)
    backend_case([(20, 1), (44, 9), (70, 1)], strided_query=True)


@settings(max_examples=30, deadline=None)
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
    kernel_case(seqs, sliding_window=window, seed=seed)
    backend_case(seqs, sliding_window=window, seed=seed)


def test_selected_sequences_leave_other_rows_alone() -> None:
    generator = torch.Generator().manual_seed(5)
    k_cache = torch.randn(8, BLOCK_SIZE, 2, 16, generator=generator)
    v_cache = torch.randn(8, BLOCK_SIZE, 2, 16, generator=generator)
    query = torch.randn(6, 4, 16, generator=generator)
    metadata = AttentionMetadata.of(
        torch.tensor([[1, 4, 0], [2, 5, 7], [3, 6, 0]], dtype=torch.int32),
        torch.tensor([0, 1, 5, 6], dtype=torch.int32),
        torch.tensor([20, 40, 33], dtype=torch.int32),
    )
    expected = torch_paged.paged_attention(query, k_cache, v_cache, metadata, 0.25)
    out = torch.full_like(query, 7.0)
    cpu_kernel.paged_attention(query, k_cache, v_cache, metadata, 0.25,
                               seq_ids=torch.tensor([0, 2], dtype=torch.int32), out=out)
    torch.testing.assert_close(out[[0, 5]], expected[[0, 5]], rtol=1e-5, atol=1e-5)
    assert out[1:5].eq(7.0).all()


def test_backend_sends_decodes_and_short_chunks_to_the_kernel_and_long_ones_to_torch() -> None:
    long_rows = cpu_backend.KERNEL_MAX_PAIRS // 300 + 1  # x 300 tokens of context: too many
    num_blocks = -(-300 // BLOCK_SIZE)
    k_cache = torch.zeros(num_blocks + 2, BLOCK_SIZE, 2, 16)
    tables = torch.zeros(4, num_blocks, dtype=torch.int32)
    metadata = AttentionMetadata.of(
        tables,
        # decode, 8-row chunk, decode, long chunk
        torch.tensor([0, 1, 9, 10, 10 + long_rows], dtype=torch.int32),
        torch.tensor([20, 30, 5, 300], dtype=torch.int32),
    )
    plan = cpu_backend.plan(metadata, k_cache)
    assert plan.kernel_seq_ids is not None and plan.kernel_seq_ids.tolist() == [0, 1, 2]
    assert [p.row_start for p in plan.prefills] == [10] and not plan.decode_groups
    half = cpu_backend.plan(metadata, k_cache.to(torch.bfloat16))  # no kernel: all torch
    assert half.kernel_seq_ids is None and len(half.decode_groups) == 1
    assert [p.row_start for p in half.prefills] == [1, 10]


def test_kernel_refuses_other_dtypes() -> None:
    query = torch.zeros(1, 2, 8, dtype=torch.bfloat16)
    cache = torch.zeros(1, BLOCK_SIZE, 1, 8, dtype=torch.bfloat16)
    metadata = AttentionMetadata.of(torch.zeros(1, 1, dtype=torch.int32),
                                    torch.tensor([0, 1], dtype=torch.int32),
                                    torch.tensor([1], dtype=torch.int32))
    with pytest.raises(cpu_kernel.CpuKernelError):
        cpu_kernel.paged_attention(query, cache, cache, metadata, 1.0)


def test_a_fresh_cache_builds_the_library_once(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cpp_build.load_library.__wrapped__(cpu_kernel.SOURCE) is not None
    [built] = (tmp_path / "tiergate" / "kernels").glob("cpu_paged_attention_*.so")
    built_at = built.stat().st_mtime_ns
    assert cpp_build.load_library.__wrapped__(cpu_kernel.SOURCE) is not None
    [again] = (tmp_path / "tiergate" / "kernels").glob("cpu_paged_attention_*.so")
    assert again == built and again.stat().st_mtime_ns == built_at  # loaded, not rebuilt


@pytest.mark.parametrize("compiler", ["/nonexistent/g++", "false"])
def test_no_kernel_without_a_working_compiler(
    compiler: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """A missing or failing compiler means no kernel (the backend keeps the PyTorch path)."""
    monkeypatch.setenv("CXX", compiler)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    assert cpp_build.load_library.__wrapped__(cpu_kernel.SOURCE) is None


@pytest.mark.parametrize(
    "layout",
    [
        ([[0, 9]], [0, 1], [20]),  # block 9 of a 4-block cache
        ([[0, 1]], [0, 1], [40]),  # context longer than its block table covers
        ([[0, 1]], [0, 3], [20]),  # rows past the query's 2 rows
        ([[0, 1]], [0, 1], [0]),  # a row with no context
    ],
)
def test_out_of_range_layouts_raise_instead_of_reading_past_the_cache(
    layout: tuple[list[list[int]], list[int], list[int]],
) -> None:
    tables, starts, lens = layout
    query = torch.zeros(2, 4, 16)
    cache = torch.zeros(4, BLOCK_SIZE, 2, 16)
    out = torch.full_like(query, 3.0)
    with pytest.raises(cpu_kernel.CpuKernelError, match="out of range"):
        metadata = AttentionMetadata.of(torch.tensor(tables, dtype=torch.int32),
                                        torch.tensor(starts, dtype=torch.int32),
                                        torch.tensor(lens, dtype=torch.int32))
        cpu_kernel.paged_attention(query, cache, cache, metadata, 1.0, out=out)
    assert out.eq(3.0).all()
