"""One step's batch layout as attention reads it: built once per step, shared by every layer."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True)
class AttentionMetadata:
    """Sequence b owns query rows query_start_loc[b]:query_start_loc[b+1]: the last q_len of
    its context_lens[b] tokens, whose K/V are in the cache once written through slot_mapping.
    num_tokens is known on the host, so telling a decode-only batch needs no device read."""

    block_tables: torch.Tensor  # int32[B, max_blocks_per_seq] KV blocks of each sequence
    query_start_loc: torch.Tensor  # int32[B + 1] first row of each sequence, then T
    context_lens: torch.Tensor  # int32[B] tokens in each context after this step
    slot_mapping: torch.Tensor  # int64[T] cache slot of each token (block * size + offset)
    num_tokens: int  # T


    @classmethod
    def of(
        cls,
        block_tables: torch.Tensor,
        query_start_loc: torch.Tensor,
        context_lens: torch.Tensor,
        slot_mapping: torch.Tensor | None = None,
    ) -> AttentionMetadata:
        """From a layout alone (tests, benchmarks): reads T back from query_start_loc; without
        slot_mapping, writes through this metadata skip every token."""
        num_tokens = int(query_start_loc[-1])
        if slot_mapping is None:
            slot_mapping = torch.full((num_tokens,), -1, dtype=torch.int64,
                                      device=block_tables.device)
        return cls(block_tables, query_start_loc, context_lens, slot_mapping, num_tokens)

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    @property
    def is_decode_only(self) -> bool:
        """One query row per sequence."""
        return self.num_tokens == self.num_seqs


class StepBinding:
    """What every backend keeps between prepare() and the layers' calls: the bound step."""

    def __init__(self) -> None:
        self._metadata: AttentionMetadata | None = None

    @property
    def metadata(self) -> AttentionMetadata:
        assert self._metadata is not None, "prepare() must come before the layers"
        return self._metadata

    def prepare(self, metadata: AttentionMetadata) -> None:
        self._metadata = metadata
