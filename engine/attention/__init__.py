"""Paged attention: the Triton kernels on CUDA, the CPU backend everywhere else.

The CPU backend (engine.attention.cpu_backend) runs decodes through a C++ kernel built at first
use and everything else through the torch reference. Both backends expose the same two
functions (see engine.attention.reference for the contract):

    write_kv(key, value, k_cache, v_cache, slot_mapping) -> None
    paged_attention(query, k_cache, v_cache, block_tables, query_start_loc, context_lens,
                    scale, sliding_window=None) -> output

The module-level functions here dispatch on the tensors' device. Models use `PagedAttention`,
which binds one step's batch layout once (`prepare`) and is then called per layer; on the CPU it
lets all layers share one host-side plan. Triton is imported only on CUDA.
"""

from __future__ import annotations

from types import ModuleType

import torch

from engine.attention import cpu_backend, cpu_kernel, reference

__all__ = ["PagedAttention", "backend_for", "paged_attention", "write_kv"]


def backend_for(device: torch.device) -> ModuleType:
    """engine.attention.triton_backend on CUDA, engine.attention.cpu_backend otherwise."""
    if device.type == "cuda":
        from engine.attention import triton_backend

        return triton_backend
    return cpu_backend


def write_kv(
    key: torch.Tensor,  # [T, Hkv, D]
    value: torch.Tensor,  # [T, Hkv, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    slot_mapping: torch.Tensor,  # int64[T]
) -> None:
    """Write each token's K and V into its cache slot (block_id * block_size + offset)."""
    backend_for(key.device).write_kv(key, value, k_cache, v_cache, slot_mapping)


def paged_attention(
    query: torch.Tensor,  # [T, H, D]
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    block_tables: torch.Tensor,  # int32[B, max_blocks_per_seq]
    query_start_loc: torch.Tensor,  # int32[B + 1]
    context_lens: torch.Tensor,  # int32[B]
    scale: float,
    sliding_window: int | None = None,
) -> torch.Tensor:  # [T, H, D]
    """Causal attention of each sequence's last q_len tokens over its cached context."""
    backend = backend_for(query.device)
    out: torch.Tensor = backend.paged_attention(
        query, k_cache, v_cache, block_tables, query_start_loc, context_lens, scale,
        sliding_window,
    )
    return out


class PagedAttention:
    """One model's attention backend: bind a step's batch once, then attend per layer."""

    def __init__(self, device: torch.device) -> None:
        self.device = device
        self._backend = backend_for(device)
        self._uses_plan = self._backend is cpu_backend
        if self._uses_plan:
            cpu_kernel.load()  # build now rather than in the first step (a fresh machine compiles)
        # (block_tables, query_start_loc, context_lens) of the bound step.
        self._layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None
        self._plan: reference.AttentionPlan | None = None  # CPU: the bound step's plan

    def prepare(
        self,
        block_tables: torch.Tensor,  # int32[B, max_blocks_per_seq]
        query_start_loc: torch.Tensor,  # int32[B + 1]
        context_lens: torch.Tensor,  # int32[B]
    ) -> None:
        """Bind the batch layout that the following attend calls use."""
        self._layout = (block_tables, query_start_loc, context_lens)
        self._plan = None  # the CPU backend plans at the first attend, when the cache is known

    def write_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        slot_mapping: torch.Tensor,  # int64[T]
    ) -> None:
        self._backend.write_kv(key, value, k_cache, v_cache, slot_mapping)

    def attend(
        self,
        query: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [T, H, D]
        assert self._layout is not None, "prepare() must come before attend()"
        if not self._uses_plan:
            out: torch.Tensor = self._backend.paged_attention(
                query, k_cache, v_cache, *self._layout, scale, sliding_window
            )
            return out
        if self._plan is None:
            self._plan = cpu_backend.plan(*self._layout, k_cache)
        return cpu_backend.paged_attention_planned(
            query, k_cache, v_cache, *self._layout, self._plan, scale, sliding_window
        )
