"""Paged attention on the CPU: the C++ kernel for decodes and short chunks, the PyTorch path
for the rest.

Decodes are memory-bound: the kernel (engine.attention.cpu_kernel) reads each sequence's K/V
blocks in place, where the PyTorch path copies them out first. A short prefill chunk pays the
PyTorch path's fixed cost per sequence (a gather, a mask, one SDPA call) for little work, and
the kernel takes it in place too. Long chunks are compute-bound and SDPA's tiled matrix
products beat the kernel's tiles of rows, so a chunk of more than KERNEL_MAX_PAIRS (query row,
context token) pairs stays on the PyTorch path: below that the kernel was as fast or faster
for every shape measured (ops/bench/journal.md, "The engine in rooms"). Without the
kernel (no compiler), for dtypes other than float32 or head sizes the kernel does not take,
everything runs on the PyTorch path.
"""

from __future__ import annotations

import torch

from engine.attention import cpu_kernel, torch_paged
from engine.attention.metadata import AttentionMetadata
from engine.attention.torch_paged import AttentionPlan, TorchPagedAttention

__all__ = ["KERNEL_MAX_PAIRS", "CpuPagedAttention", "plan"]

# Decodes, and chunks of at most this many query rows x context tokens, go to the kernel.
KERNEL_MAX_PAIRS = 256 * 256


def plan(metadata: AttentionMetadata, k_cache: torch.Tensor) -> AttentionPlan:
    """The PyTorch path's plan, with the kernel's sequences set apart when the kernel applies
    (k_cache: any layer's, for its layout and dtype)."""
    uses_kernel = (
        k_cache.dtype == torch.float32
        and cpu_kernel.supports_head_dim(k_cache.shape[3])
        and cpu_kernel.load() is not None
    )
    return torch_paged.plan_attention(metadata, k_cache,
                                      KERNEL_MAX_PAIRS if uses_kernel else None)


class CpuPagedAttention(TorchPagedAttention):
    """The PyTorch path with its plan's decodes and short chunks set apart for the kernel."""

    def __init__(self) -> None:
        super().__init__()
        cpu_kernel.load()  # build now rather than in the first step (a fresh machine compiles)

    def attend(self, query: torch.Tensor, k_cache: torch.Tensor, v_cache: torch.Tensor,
               scale: float, sliding_window: int | None) -> torch.Tensor:
        step_plan = self.plan(k_cache)
        out = torch.empty(query.shape, dtype=query.dtype, device=query.device)
        if step_plan.kernel_seq_ids is not None:
            cpu_kernel.paged_attention(query, k_cache, v_cache, self.metadata, scale,
                                       sliding_window, seq_ids=step_plan.kernel_seq_ids, out=out)
        return torch_paged.paged_attention_planned(query, k_cache, v_cache, step_plan, scale,
                                                   sliding_window, out)

    def _make_plan(self, k_cache: torch.Tensor) -> AttentionPlan:
        return plan(self.metadata, k_cache)
