"""Where a CPU step's attention goes: the C++ kernel against the PyTorch path, per shape.

    python -m ops.bench.attention_routes [--repeats 20] [--seed 0]

The figure behind `engine.attention.cpu_backend.KERNEL_MAX_PAIRS`: for sequences of r query
rows over c tokens of context (r x c pairs), the time of one layer's attention on the
PyTorch path (gather, mask, SDPA per sequence) over the kernel's (in place, tiles of rows).
Shapes: the demo model's heads (4 query, 2 KV, head_dim 64) and SmolLM2-135M's (9, 3, 64),
blocks of 16 tokens scattered over the cache. Printed: milliseconds each (the minimum of
--repeats), the ratio, and the outputs' largest difference.
"""

from __future__ import annotations

import argparse
import functools
import time
from collections.abc import Callable

import torch

from engine.attention import AttentionMetadata, cpu_kernel, torch_paged

BLOCK_SIZE = 16
HEADS = {"demo": (4, 2, 64), "SmolLM2-135M": (9, 3, 64)}
# (sequences, query rows each, context tokens each)
SHAPES = [(32, 1, 512), (32, 4, 4), (4, 64, 64), (1, 256, 256), (1, 512, 512), (1, 1024, 1024)]


def _case(heads: tuple[int, int, int], seqs: int, rows: int, ctx: int,
          generator: torch.Generator) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor,
                                               AttentionMetadata]:
    num_heads, num_kv_heads, head_dim = heads
    blocks_per_seq = -(-ctx // BLOCK_SIZE)
    num_blocks = seqs * blocks_per_seq
    k_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=generator)
    v_cache = torch.randn(num_blocks, BLOCK_SIZE, num_kv_heads, head_dim, generator=generator)
    tables = torch.randperm(num_blocks, generator=generator).to(torch.int32)
    metadata = AttentionMetadata.of(
        tables.view(seqs, blocks_per_seq),
        torch.arange(0, seqs * rows + 1, rows, dtype=torch.int32),
        torch.full((seqs,), ctx, dtype=torch.int32),
    )
    query = torch.randn(seqs * rows, num_heads, head_dim, generator=generator)
    return query, k_cache, v_cache, metadata


def _best(run: Callable[[], torch.Tensor], repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return min(times)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    if cpu_kernel.load() is None:
        raise SystemExit("the CPU attention kernel does not build here")
    generator = torch.Generator().manual_seed(args.seed)
    print(f"one layer's attention, ms (min of {args.repeats}); {torch.get_num_threads()} threads")
    print("| heads | sequences x rows @ context | pairs per sequence | PyTorch path | kernel "
          "| PyTorch / kernel | max difference |")
    print("|---|---|---|---|---|---|---|")
    for name, heads in HEADS.items():
        for seqs, rows, ctx in SHAPES:
            query, k_cache, v_cache, metadata = _case(heads, seqs, rows, ctx, generator)
            scale = heads[2] ** -0.5
            inputs = (query, k_cache, v_cache, metadata, scale)
            with torch.inference_mode():
                slow = _best(functools.partial(torch_paged.paged_attention, *inputs),
                             args.repeats)
                fast = _best(functools.partial(cpu_kernel.paged_attention, *inputs),
                             args.repeats)
                diff = (torch_paged.paged_attention(*inputs)
                        - cpu_kernel.paged_attention(*inputs)).abs().max().item()
            print(f"| {name} | {seqs} x {rows} @ {ctx} | {rows * ctx} | {slow * 1e3:.3f} | "
                  f"{fast * 1e3:.3f} | {slow / fast:.2f} | {diff:.1e} |", flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
