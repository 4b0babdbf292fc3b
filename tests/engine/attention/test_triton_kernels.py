"""Triton attention kernels against dense attention and against engine.attention.torch_paged.

Without CUDA the kernels run under the Triton interpreter (TRITON_INTERPRET=1, which the Makefile
sets for the whole run and this module sets if nobody did); shapes stay tiny because the
interpreter executes every program in Python. With CUDA the same cases also run on the GPU.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import torch

if not torch.cuda.is_available():
    # Must happen before triton decorates the kernels: @triton.jit reads it at import time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from engine.attention import AttentionMetadata, torch_paged
from engine.attention.triton_backend import TritonPagedAttention
from engine.attention.triton_decode import paged_decode
from engine.attention.triton_kv_write import write_kv
from engine.attention.triton_paged_tile import is_interpreting
from engine.attention.triton_prefill import _prefill_kernel, paged_prefill
from tests.engine.attention.dense import dense_attention

if not torch.cuda.is_available() and type(_prefill_kernel).__name__ != "InterpretedFunction":
    raise RuntimeError(
        "no CUDA device and the Triton kernels were imported without TRITON_INTERPRET=1; "
        "run the tests with TRITON_INTERPRET=1 (make test sets it)"
    )

DEVICES = (["cpu"] if is_interpreting() else []) + (["cuda"] if torch.cuda.is_available() else [])
DTYPES = [torch.float32, torch.bfloat16, torch.float16]
# Relative error (Frobenius norm of the difference over the norm of the expected output).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 1e-2}


@dataclass
class PagedBatch:
    """A batch laid out in a paged cache, with its dense per-sequence K/V kept for checking."""

    query: torch.Tensor  # [T, H, D]
    k_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor  # int32[B, max_blocks_per_seq]
    query_start_loc: torch.Tensor  # int32[B + 1]
    context_lens: torch.Tensor  # int32[B]
    keys: list[torch.Tensor]  # per sequence [context_len, Hkv, D]
    values: list[torch.Tensor]  # per sequence [context_len, Hkv, D]
    scale: float


def make_batch(
    query_lens: list[int],
    context_lens: list[int],
    *,
    num_heads: int = 4,
    num_kv_heads: int = 2,
    head_dim: int = 16,
    block_size: int = 4,
    dtype: torch.dtype = torch.float32,
    device: str = "cpu",
    seed: int = 0,
) -> PagedBatch:
    """Random Q/K/V; each sequence's blocks are scattered over a shuffled pool (non-contiguous)."""
    gen = torch.Generator().manual_seed(seed)
    blocks_per_seq = [-(-c // block_size) for c in context_lens]
    num_blocks = sum(blocks_per_seq) + 3  # spare blocks, never referenced, hold garbage
    pool_order = torch.randperm(num_blocks, generator=gen)
    max_blocks = max(blocks_per_seq) + 1  # one unused column: tables are wider than needed
    block_tables = torch.zeros(len(context_lens), max_blocks, dtype=torch.int32)
    k_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    v_cache = torch.randn(num_blocks, block_size, num_kv_heads, head_dim, generator=gen)
    keys, values = [], []
    next_block = 0
    for seq, (num_ctx, num_seq_blocks) in enumerate(zip(context_lens, blocks_per_seq, strict=True)):
        table = pool_order[next_block : next_block + num_seq_blocks]
        next_block += num_seq_blocks
        block_tables[seq, :num_seq_blocks] = table.int()
        key = torch.randn(num_ctx, num_kv_heads, head_dim, generator=gen)
        value = torch.randn(num_ctx, num_kv_heads, head_dim, generator=gen)
        positions = torch.arange(num_ctx)
        k_cache[table[positions // block_size].long(), positions % block_size] = key
        v_cache[table[positions // block_size].long(), positions % block_size] = value
        keys.append(key.to(dtype).to(device))
        values.append(value.to(dtype).to(device))
    starts = [0]
    for num_q in query_lens:
        starts.append(starts[-1] + num_q)
    query = torch.randn(starts[-1], num_heads, head_dim, generator=gen)
    return PagedBatch(
        query=query.to(dtype).to(device),
        k_cache=k_cache.to(dtype).to(device),
        v_cache=v_cache.to(dtype).to(device),
        block_tables=block_tables.to(device),
        query_start_loc=torch.tensor(starts, dtype=torch.int32, device=device),
        context_lens=torch.tensor(context_lens, dtype=torch.int32, device=device),
        keys=keys,
        values=values,
        scale=head_dim**-0.5,
    )


def dense_output(batch: PagedBatch, sliding_window: int | None = None) -> torch.Tensor:
    """Dense attention of each sequence (dense.dense_attention) from its dense K/V, no paging
    involved, in float32: [T, H, D]."""
    starts = batch.query_start_loc.tolist()
    return torch.cat([
        dense_attention(batch.query[start:end].float(), keys.float(), values.float(),
                        batch.scale, sliding_window)
        for start, end, keys, values in zip(starts[:-1], starts[1:], batch.keys, batch.values,
                                            strict=True)
    ])


def relative_error(actual: torch.Tensor, expected: torch.Tensor) -> float:
    diff = (actual.float() - expected.float()).norm()
    return float(diff / expected.float().norm())


def metadata(batch: PagedBatch, slot_mapping: torch.Tensor | None = None) -> AttentionMetadata:
    return AttentionMetadata.of(batch.block_tables, batch.query_start_loc, batch.context_lens,
                                slot_mapping)


def batch_args(
    batch: PagedBatch,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]:
    return batch.query, batch.k_cache, batch.v_cache, metadata(batch)


def attend(backend: TritonPagedAttention, batch: PagedBatch) -> torch.Tensor:
    return backend.attend(batch.query, batch.k_cache, batch.v_cache, batch.scale, None)


def check(out: torch.Tensor, batch: PagedBatch, sliding_window: int | None = None) -> None:
    """Against dense attention and against the PyTorch path over the paged layout."""
    assert out.shape == batch.query.shape and out.dtype == batch.query.dtype
    tolerance = TOLERANCE[batch.query.dtype]
    assert relative_error(out, dense_output(batch, sliding_window)) <= tolerance
    expected = torch_paged.paged_attention(*batch_args(batch), batch.scale, sliding_window)
    assert relative_error(out, expected) <= tolerance


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_scatters_into_slots_and_skips_padding(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    num_blocks, block_size, num_kv_heads, head_dim = 6, 4, 3, 20
    k_cache = torch.zeros(num_blocks, block_size, num_kv_heads, head_dim, dtype=dtype)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([13, 2, -1, 23, 0, 17, -1], dtype=torch.int64)
    key = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(dtype)
    value = torch.randn(len(slots), num_kv_heads, head_dim, generator=gen).to(dtype)
    expected_k, expected_v = k_cache.clone(), v_cache.clone()
    valid = slots >= 0
    expected_k.view(-1, num_kv_heads, head_dim)[slots[valid]] = key[valid]
    expected_v.view(-1, num_kv_heads, head_dim)[slots[valid]] = value[valid]

    k_dev, v_dev = k_cache.to(device), v_cache.to(device)
    write_kv(key.to(device), value.to(device), k_dev, v_dev, slots.to(device))
    assert torch.equal(k_dev.cpu(), expected_k)
    assert torch.equal(v_dev.cpu(), expected_v)

    ref_k, ref_v = k_cache.clone(), v_cache.clone()
    torch_paged.write_kv(key, value, ref_k, ref_v, slots)
    assert torch.equal(k_dev.cpu(), ref_k) and torch.equal(v_dev.cpu(), ref_v)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_splits_context_over_several_partitions(device: str, dtype: torch.dtype) -> None:
    # Partitions of 16 keys: the 70-token context spans 5 of them, the 3-token one only the first.
    batch = make_batch([1, 1, 1, 1], [37, 3, 70, 16], dtype=dtype, device=device)
    out = paged_decode(*batch_args(batch), batch.scale, partition_size=16, block_n=16)
    check(out, batch)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_single_partition_writes_output_directly(device: str) -> None:
    batch = make_batch([1, 1], [9, 30], device=device)
    out = paged_decode(*batch_args(batch), batch.scale, partition_size=64, block_n=16)
    check(out, batch)


@pytest.mark.parametrize("device", DEVICES)
def test_decode_gqa_wide_group_and_odd_head_dim(device: str) -> None:
    batch = make_batch([1, 1], [21, 45], num_heads=8, num_kv_heads=1, head_dim=24, device=device)
    out = paged_decode(*batch_args(batch), batch.scale, partition_size=32, block_n=16)
    check(out, batch)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_mixed_with_cached_prefix(device: str, dtype: torch.dtype) -> None:
    # A fresh prompt, a 17-token chunk after 23 cached tokens, and a decode in the same batch.
    batch = make_batch([5, 17, 1], [5, 40, 9], dtype=dtype, device=device)
    out = paged_prefill(*batch_args(batch), batch.scale, block_m=16, block_n=16)
    check(out, batch)


@pytest.mark.parametrize("device", DEVICES)
def test_prefill_gqa_odd_lengths_and_head_dim(device: str) -> None:
    batch = make_batch(
        [3, 19, 7], [11, 19, 30], num_heads=6, num_kv_heads=2, head_dim=24, block_size=8,
        device=device,
    )
    out = paged_prefill(*batch_args(batch), batch.scale, block_m=16, block_n=16)
    check(out, batch)


@pytest.mark.parametrize("device", DEVICES)
def test_sliding_window_in_both_kernels(device: str) -> None:
    prefill = make_batch([5, 20, 1], [5, 41, 9], device=device, seed=3)
    out = paged_prefill(*batch_args(prefill), prefill.scale, 7, block_m=16, block_n=16)
    check(out, prefill, sliding_window=7)

    decode = make_batch([1, 1, 1], [37, 3, 70], device=device, seed=4)
    out = paged_decode(*batch_args(decode), decode.scale, 20, partition_size=16, block_n=16)
    check(out, decode, sliding_window=20)


@pytest.mark.parametrize("device", DEVICES)
def test_backend_dispatches_decode_and_prefill(device: str) -> None:
    backend = TritonPagedAttention()
    decode = make_batch([1, 1], [13, 50], device=device, seed=5)
    backend.prepare(metadata(decode))
    assert backend.metadata.is_decode_only
    check(attend(backend, decode), decode)
    mixed = make_batch([1, 6], [13, 50], device=device, seed=6)
    backend.prepare(metadata(mixed))
    assert not backend.metadata.is_decode_only
    check(attend(backend, mixed), mixed)


@pytest.mark.parametrize("device", DEVICES)
def test_backend_writes_then_attends(device: str) -> None:
    """The path the model runner takes: write the chunk's K/V, then attend over the cache."""
    batch = make_batch([4, 1], [10, 6], device=device, seed=7)
    slots, keys, values = [], [], []
    block_size = batch.k_cache.shape[1]
    starts = batch.query_start_loc.tolist()
    for seq, num_ctx in enumerate(batch.context_lens.tolist()):
        num_new = starts[seq + 1] - starts[seq]
        for pos in range(num_ctx - num_new, num_ctx):
            block_id = int(batch.block_tables[seq, pos // block_size])
            slots.append(block_id * block_size + pos % block_size)
        keys.append(batch.keys[seq][-num_new:])
        values.append(batch.values[seq][-num_new:])
    # Wipe the new tokens' slots first so the test fails if the write does not land.
    slot_mapping = torch.tensor(slots, dtype=torch.int64, device=device)
    flat_k = batch.k_cache.view(-1, *batch.k_cache.shape[2:])
    flat_v = batch.v_cache.view(-1, *batch.v_cache.shape[2:])
    flat_k[slot_mapping] = 0.0
    flat_v[slot_mapping] = 0.0
    backend = TritonPagedAttention()
    backend.prepare(metadata(batch, slot_mapping))
    backend.write_kv(torch.cat(keys), torch.cat(values), batch.k_cache, batch.v_cache)
    check(attend(backend, batch), batch)


FP8 = torch.float8_e4m3fn


def as_fp8_cache(batch: PagedBatch) -> PagedBatch:
    """The batch over an fp8 (E4M3) cache: its K/V rounded to fp8, the dense copies too."""

    def rounded(rows: torch.Tensor) -> torch.Tensor:
        return rows.to(FP8).to(rows.dtype)

    return PagedBatch(
        query=batch.query, k_cache=batch.k_cache.to(FP8), v_cache=batch.v_cache.to(FP8),
        block_tables=batch.block_tables, query_start_loc=batch.query_start_loc,
        context_lens=batch.context_lens, keys=[rounded(k) for k in batch.keys],
        values=[rounded(v) for v in batch.values], scale=batch.scale)


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_write_kv_into_an_fp8_cache_rounds_and_saturates(device: str, dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(2)
    k_cache = torch.zeros(4, 4, 2, 16, dtype=FP8, device=device)
    v_cache = torch.zeros_like(k_cache)
    slots = torch.tensor([5, -1, 0, 14], dtype=torch.int64, device=device)
    key = (torch.randn(4, 2, 16, generator=gen) * 20).to(dtype)
    key[0, 0, :4] = torch.tensor([1000.0, -1000.0, 448.0, -500.0]).to(dtype)  # past E4M3's 448
    # Subnormals (steps of 2^-9) with a tie to even, and ties of normal values.
    key[0, 1, :6] = torch.tensor([0.001, -2.5 * 2**-9, 3.5 * 2**-9, 2**-7, 9.0, -19.0]).to(dtype)
    value = torch.randn(4, 2, 16, generator=gen).to(dtype)
    write_kv(key.to(device), value.to(device), k_cache, v_cache, slots)
    valid = (slots >= 0).cpu()
    for cache, rows in ((k_cache, key), (v_cache, value)):
        got = cache.view(-1, 2, 16).cpu()[slots.cpu()[valid]].float()
        expected = rows[valid].float().clamp(-448.0, 448.0).to(FP8).float()
        assert torch.equal(got, expected)  # as torch rounds: to nearest, ties to even
    assert float(k_cache.view(-1, 2, 16)[5, 0, :4].float().abs().max()) == 448.0


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", DTYPES)
def test_kernels_read_an_fp8_cache(device: str, dtype: torch.dtype) -> None:
    """Decode and prefill over fp8 K/V against dense attention over the same rounded K/V."""
    decode = as_fp8_cache(make_batch([1, 1, 1], [37, 3, 70], dtype=dtype, device=device))
    out = paged_decode(*batch_args(decode), decode.scale, partition_size=16, block_n=16)
    assert out.dtype == dtype
    assert relative_error(out, dense_output(decode)) <= TOLERANCE[dtype]
    mixed = as_fp8_cache(make_batch([5, 17, 1], [5, 40, 9], dtype=dtype, device=device))
    out = paged_prefill(*batch_args(mixed), mixed.scale, block_m=16, block_n=16)
    assert relative_error(out, dense_output(mixed)) <= TOLERANCE[dtype]
    backend = TritonPagedAttention()  # the backend takes the fp8 cache with any query dtype
    backend.prepare(metadata(decode))
    assert relative_error(attend(backend, decode), dense_output(decode)) <= TOLERANCE[dtype]
