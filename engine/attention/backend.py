"""The attention backend type: what a model's layers call, whatever runs underneath.

A backend binds one step's `AttentionMetadata` (`prepare`), then per layer writes the new
tokens' K and V into that layer's paged cache and attends. Implementations:
`TorchPagedAttention` (plain PyTorch, any device), `CpuPagedAttention` (the C++ kernel for
decode rows, PyTorch for the rest) and `TritonPagedAttention` (CUDA).
"""

from __future__ import annotations

from typing import Protocol

import torch

from engine.attention.metadata import AttentionMetadata


class AttentionBackend(Protocol):
    @property
    def metadata(self) -> AttentionMetadata:
        """The bound step's layout (prepare() first)."""
        ...

    def prepare(self, metadata: AttentionMetadata) -> None:
        """Bind the step's layout for the following calls."""
        ...

    def write_kv(
        self,
        key: torch.Tensor,  # [T, Hkv, D]
        value: torch.Tensor,  # [T, Hkv, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    ) -> None:
        """Write each token's K and V into its slot (slot -1: skipped), in place."""
        ...

    def attend(
        self,
        query: torch.Tensor,  # [T, H, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
        scale: float,
        sliding_window: int | None,
    ) -> torch.Tensor:  # [T, H, D]
        """Causal attention of each sequence's query rows over its cached context (a sliding
        window W sees only the W newest keys, itself included)."""
        ...


def attention_backend(device: torch.device) -> AttentionBackend:
    """Triton on CUDA (imported only there), the CPU kernel backend elsewhere."""
    if device.type == "cuda":
        from engine.attention.triton_backend import TritonPagedAttention

        return TritonPagedAttention()
    from engine.attention.cpu_backend import CpuPagedAttention

    return CpuPagedAttention()
