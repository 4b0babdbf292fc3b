"""Paged attention on CUDA through Triton, as an attention backend.

Decode-only batches (one query row per sequence) go to the split-KV decode kernels and
everything else (prefill chunks, possibly mixed with decodes) to the prefill kernel. Both
kernels implement sliding windows, so no call falls back to the PyTorch path. The cache holds
the queries' dtype or float8 E4M3 (`--kv-cache-dtype fp8`): the kernels convert each K/V tile
to the queries' dtype as they read it, and the write rounds rows into it (triton_kv_write).

Inputs must live on a CUDA device, or on the CPU with TRITON_INTERPRET=1 set before Triton was
imported (the interpreter is what the CPU test suite uses; it is far too slow to serve with).
Every sequence must contribute at least one query row, and every context_len must be >= its
query count: decode is told from prefill by the metadata's host-side counts, without reading
lengths back from the device.
"""

from __future__ import annotations

import torch

from engine.attention import triton_kv_write
from engine.attention.metadata import StepBinding
from engine.attention.triton_decode import paged_decode
from engine.attention.triton_paged_tile import is_interpreting
from engine.attention.triton_prefill import paged_prefill

__all__ = ["TritonPagedAttention"]

SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)

# Tile sizes for GPUs. The interpreter (CPU tests) runs each program in Python, where large
# tiles cost little and fewer programs save a lot; the tests pass their own small sizes.
DECODE_PARTITION_SIZE = 512  # keys per decode partition
DECODE_BLOCK_N = 64  # keys per decode inner tile
PREFILL_BLOCK_M = 64  # query rows per prefill program
PREFILL_BLOCK_N = 64  # keys per prefill inner tile


def _check_inputs(query: torch.Tensor, k_cache: torch.Tensor) -> None:
    if not (query.is_cuda or is_interpreting()):
        raise RuntimeError(
            "the Triton attention backend needs CUDA tensors (or TRITON_INTERPRET=1 for tests); "
            "use engine.attention.cpu_backend on the CPU"
        )
    if query.dtype not in SUPPORTED_DTYPES or k_cache.dtype not in (query.dtype,
                                                                     torch.float8_e4m3fn):
        raise TypeError(f"unsupported dtypes: query {query.dtype}, cache {k_cache.dtype}")


class TritonPagedAttention(StepBinding):
    """Triton kernels over a bound step: decode-only batches to the split-KV kernels."""

    def write_kv(self, key: torch.Tensor, value: torch.Tensor, k_cache: torch.Tensor,
                 v_cache: torch.Tensor) -> None:
        _check_inputs(key, k_cache)
        triton_kv_write.write_kv(key, value, k_cache, v_cache, self.metadata.slot_mapping)

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float, sliding_window: int | None) -> torch.Tensor:
        _check_inputs(query, k_cache)
        metadata = self.metadata
        if metadata.is_decode_only:
            return paged_decode(query, k_cache, v_cache, metadata, scale, sliding_window,
                                partition_size=DECODE_PARTITION_SIZE, block_n=DECODE_BLOCK_N)
        return paged_prefill(query, k_cache, v_cache, metadata, scale, sliding_window,
                             block_m=PREFILL_BLOCK_M, block_n=PREFILL_BLOCK_N)
