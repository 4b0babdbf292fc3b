"""Time the Triton attention kernels against the PyTorch path on CUDA; prints a table.

    python tests/engine/attention/bench_kernels.py [--dtype bfloat16] [--seed 0]

A script, not a test: it needs a GPU and never gates CI. Shapes are Llama-3-8B-like per layer
(32 query heads, 8 KV heads, head_dim 128, blocks of 16 tokens); each sequence's blocks are
scattered over a shuffled pool as in a busy cache.
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable
from dataclasses import dataclass

import torch

from engine.attention import AttentionMetadata

NUM_HEADS = 32
NUM_KV_HEADS = 8
HEAD_DIM = 128
BLOCK_SIZE = 16


@dataclass
class Case:
    """One benchmark row: a batch shape."""

    name: str  # what the row measures
    query_lens: list[int]  # query rows per sequence
    context_lens: list[int]  # context length per sequence (cached prefix + queries)


CASES = [
    Case("decode b=1 ctx=1k", [1], [1024]),
    Case("decode b=1 ctx=32k", [1], [32768]),
    Case("decode b=32 ctx=2k", [1] * 32, [2048] * 32),
    Case("decode b=128 ctx=1k", [1] * 128, [1024] * 128),
    Case("decode b=64 ctx=mixed", [1] * 64, [128 + 61 * i for i in range(64)]),
    Case("prefill 1x2k", [2048], [2048]),
    Case("prefill 4x512 + 8k prefix", [512] * 4, [8704] * 4),
    Case("mixed 16 decodes + 1x1k chunk", [1] * 16 + [1024], [2048] * 16 + [3072]),
]


# query, k_cache, v_cache, the layout
BatchTensors = tuple[torch.Tensor, torch.Tensor, torch.Tensor, AttentionMetadata]


def build(case: Case, dtype: torch.dtype, gen: torch.Generator) -> BatchTensors:
    blocks_per_seq = [-(-c // BLOCK_SIZE) for c in case.context_lens]
    num_blocks = sum(blocks_per_seq)
    order = torch.randperm(num_blocks, generator=gen)
    tables = torch.zeros(len(blocks_per_seq), max(blocks_per_seq), dtype=torch.int32)
    next_block = 0
    for seq, num_seq_blocks in enumerate(blocks_per_seq):
        tables[seq, :num_seq_blocks] = order[next_block : next_block + num_seq_blocks].int()
        next_block += num_seq_blocks
    starts = [0]
    for num_q in case.query_lens:
        starts.append(starts[-1] + num_q)
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.randn(shape, generator=gen).to(dtype)
    v_cache = torch.randn(shape, generator=gen).to(dtype)
    query = torch.randn(starts[-1], NUM_HEADS, HEAD_DIM, generator=gen).to(dtype)
    metadata = AttentionMetadata.of(
        tables.cuda(),
        torch.tensor(starts, dtype=torch.int32, device="cuda"),
        torch.tensor(case.context_lens, dtype=torch.int32, device="cuda"),
    )
    return query.cuda(), k_cache.cuda(), v_cache.cuda(), metadata


def time_ms(fn: Callable[[], object], num_iters: int) -> float:
    """Median of CUDA-event timings after a warm-up (which also compiles the kernels)."""
    for _ in range(3):
        fn()
    torch.cuda.synchronize()
    samples = []
    for _ in range(num_iters):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        fn()
        end.record()
        torch.cuda.synchronize()
        samples.append(start.elapsed_time(end))
    return sorted(samples)[len(samples) // 2]


def print_row(name: str, num_tokens: int, triton_ms: float, ref_ms: float, error: str) -> None:
    speedup = f"{ref_ms / triton_ms:.1f}x"
    print(f"{name:32} {num_tokens:>7} {triton_ms:>10.3f} {ref_ms:>10.3f} {speedup:>8} {error:>9}")


def bench_attention(case: Case, dtype: torch.dtype, gen: torch.Generator, num_iters: int) -> None:
    from engine.attention import torch_paged
    from engine.attention.triton_backend import TritonPagedAttention

    query, k_cache, v_cache, metadata = build(case, dtype, gen)
    scale = HEAD_DIM**-0.5
    backend = TritonPagedAttention()
    backend.prepare(metadata)

    def triton_run() -> torch.Tensor:
        return backend.attend(query, k_cache, v_cache, scale, None)

    def torch_run() -> torch.Tensor:
        return torch_paged.paged_attention(query, k_cache, v_cache, metadata, scale)

    out = triton_run()
    expected = torch_run().float()
    error = float((out.float() - expected).norm() / expected.norm())
    triton_ms = time_ms(triton_run, num_iters)
    ref_ms = time_ms(torch_run, max(3, num_iters // 4))
    print_row(case.name, query.shape[0], triton_ms, ref_ms, f"{error:.2e}")


def bench_write_kv(
    num_tokens: int, dtype: torch.dtype, gen: torch.Generator, num_iters: int
) -> None:
    from engine.attention import torch_paged, triton_kv_write

    num_blocks = -(-num_tokens // BLOCK_SIZE) * 2
    shape = (num_blocks, BLOCK_SIZE, NUM_KV_HEADS, HEAD_DIM)
    k_cache = torch.zeros(shape, dtype=dtype, device="cuda")
    v_cache = torch.zeros_like(k_cache)
    key = torch.randn(num_tokens, NUM_KV_HEADS, HEAD_DIM, generator=gen).to(dtype).cuda()
    value = torch.randn_like(key)
    slots = torch.randperm(num_blocks * BLOCK_SIZE, generator=gen)[:num_tokens].cuda()
    triton_ms = time_ms(
        lambda: triton_kv_write.write_kv(key, value, k_cache, v_cache, slots), num_iters
    )
    ref_ms = time_ms(lambda: torch_paged.write_kv(key, value, k_cache, v_cache, slots), num_iters)
    print_row(f"write_kv {num_tokens} tokens", num_tokens, triton_ms, ref_ms, "")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "float16", "bfloat16"])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--iters", type=int, default=20)
    args = parser.parse_args()
    if not torch.cuda.is_available():
        print("bench_kernels needs a CUDA device", file=sys.stderr)
        return 1
    dtype = getattr(torch, args.dtype)
    gen = torch.Generator().manual_seed(args.seed)
    print(f"{torch.cuda.get_device_name()}  dtype={args.dtype}  seed={args.seed}")
    columns = ["case", "tokens", "triton ms", "ref ms", "speedup", "rel err"]
    header = f"{columns[0]:32} " + " ".join(
        f"{c:>{w}}" for c, w in zip(columns[1:], [7, 10, 10, 8, 9], strict=True)
    )
    print(header)
    print("-" * len(header))
    for case in CASES:
        bench_attention(case, dtype, gen, args.iters)
    # KV write: one decode step of 256 sequences and one 8k-token prefill.
    for num_tokens in (256, 8192):
        bench_write_kv(num_tokens, dtype, gen, args.iters)
    return 0


if __name__ == "__main__":
    sys.exit(main())
