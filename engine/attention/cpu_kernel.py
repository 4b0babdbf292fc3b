"""Paged attention on the CPU through a small C++ kernel that reads K/V blocks in place.

The PyTorch path gathers every sequence's blocks into contiguous memory before SDPA; on a
CPU that copy can cost as much as the attention itself. cpu_paged_attention.cpp walks each
block table instead. engine.attention.cpp_build builds it at first use; a missing compiler, a
failed build or a result that disagrees with the PyTorch path leaves `load()` returning None,
and callers keep the PyTorch path.

Same contract as engine.attention.torch_paged.paged_attention, for float32 CPU tensors whose
head_dim is a multiple of 8 up to 256.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from collections.abc import Callable
from pathlib import Path

import torch

from engine.attention import cpp_build
from engine.attention.metadata import AttentionMetadata

__all__ = ["CpuKernelError", "load", "paged_attention", "supports_head_dim"]

logger = logging.getLogger(__name__)

# The bound C function (argument types set by load): writes into out, returns 0, or -1 for a
# batch layout that points outside the tensors (nothing written then).
KernelFunction = Callable[..., int]

SOURCE = Path(__file__).with_name("cpu_paged_attention.cpp")
_LANES = 8  # floats per vector in the kernel
_MAX_HEAD_DIM = 256  # the kernel's register arrays hold at most this many floats
# The load-time check against the PyTorch path: relative error bound on a small random batch.
_CHECK_TOLERANCE = 1e-4


class CpuKernelError(RuntimeError):
    """The CPU attention kernel cannot run this call: not built, not float32 CPU tensors, or a
    batch layout pointing outside the query or the cache."""


@functools.cache
def load() -> KernelFunction | None:
    """The compiled kernel (built and cached on first call), or None where it cannot be had."""
    library = cpp_build.load_library(SOURCE)
    if library is None:
        return None
    function = library["tiergate_paged_attention_f32"]
    p, i64 = ctypes.c_void_p, ctypes.c_int64
    function.argtypes = [p, i64, i64, p, p, i64, p, i64, p, p, i64, p, i64, i64, i64, i64, i64,
                         ctypes.c_float, i64, p]
    function.restype = ctypes.c_int
    if not _agrees_with_torch_path(function):
        logger.warning("CPU attention kernel disagrees with the PyTorch path; not using it")
        return None
    return function


def supports_head_dim(head_dim: int) -> bool:
    """The kernel works in 8-float vectors over head_dim, at most 256 floats."""
    return head_dim % _LANES == 0 and head_dim <= _MAX_HEAD_DIM


def paged_attention(
    query: torch.Tensor,  # [T, H, D]; rows may be strided (a view into a fused qkv)
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None = None,
    seq_ids: torch.Tensor | None = None,  # int32[K]: attend only these sequences' rows
    out: torch.Tensor | None = None,  # [T, H, D] contiguous; rows of other sequences are kept
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each sequence's last q_len tokens over its cached context."""
    function = load()
    if function is None:
        raise CpuKernelError("the CPU attention kernel is not available on this machine")
    tensors = (query, k_cache, v_cache)
    if any(t.device.type != "cpu" or t.dtype != torch.float32 for t in tensors):
        raise CpuKernelError("the CPU attention kernel takes float32 CPU tensors")
    if not supports_head_dim(query.shape[2]):
        raise CpuKernelError(f"the CPU attention kernel cannot take head_dim {query.shape[2]}")
    if out is None:
        out = torch.empty(query.shape, dtype=query.dtype)
    assert out.is_contiguous() and out.shape == query.shape
    return _run(function, query, k_cache, v_cache, metadata, scale, sliding_window, seq_ids,
                out)


def _run(
    function: KernelFunction,
    query: torch.Tensor,
    k_cache: torch.Tensor,
    v_cache: torch.Tensor,
    metadata: AttentionMetadata,
    scale: float,
    sliding_window: int | None,
    seq_ids: torch.Tensor | None,
    out: torch.Tensor,
) -> torch.Tensor:
    if query.stride(2) != 1 or query.stride(1) != query.shape[2]:
        query = query.contiguous()  # the kernel needs each row's heads contiguous
    k_cache, v_cache = k_cache.contiguous(), v_cache.contiguous()
    tables = metadata.block_tables.to(torch.int32).contiguous()
    starts = metadata.query_start_loc.to(torch.int32).contiguous()
    lens = metadata.context_lens.to(torch.int32).contiguous()
    ids = None if seq_ids is None else seq_ids.to(torch.int32).contiguous()
    status = function(
        query.data_ptr(), query.stride(0), query.shape[0], k_cache.data_ptr(),
        v_cache.data_ptr(), k_cache.shape[0], tables.data_ptr(), tables.stride(0),
        starts.data_ptr(), lens.data_ptr(), lens.shape[0],
        None if ids is None else ids.data_ptr(), 0 if ids is None else ids.shape[0],
        query.shape[1], k_cache.shape[2], query.shape[2], k_cache.shape[1], scale,
        sliding_window or 0, out.data_ptr(),
    )
    if status != 0:
        raise CpuKernelError("batch layout out of range: a sequence's rows or blocks fall "
                             "outside the query or the cache")
    return out


def _agrees_with_torch_path(function: KernelFunction) -> bool:
    """One small mixed batch (decodes, a prefill over a prefix, a window) against the PyTorch
    path."""
    from engine.attention import torch_paged

    generator = torch.Generator().manual_seed(0)
    k_cache = torch.randn(12, 4, 2, 8, generator=generator)
    v_cache = torch.randn(12, 4, 2, 8, generator=generator)
    metadata = AttentionMetadata.of(
        torch.tensor([[3, 7, 1], [0, 5, 9], [11, 2, 0]], dtype=torch.int32),  # block tables
        torch.tensor([0, 1, 6, 7], dtype=torch.int32),  # a decode, a 5-row prefill, a decode
        torch.tensor([9, 12, 5], dtype=torch.int32),  # context lengths
    )
    query = torch.randn(7, 4, 8, generator=generator)
    for window in (None, 3):
        expected = torch_paged.paged_attention(query, k_cache, v_cache, metadata, 0.3, window)
        out = _run(function, query, k_cache, v_cache, metadata, 0.3, window, None,
                   torch.empty_like(query))
        if not bool((out - expected).norm() / expected.norm() < _CHECK_TOLERANCE):
            return False
    return True
