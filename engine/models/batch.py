"""The flattened inputs of one forward pass: every token of the step in one batch, no padding."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from engine.attention.metadata import AttentionMetadata


@dataclass
class ForwardBatch:
    """Tensors the model reads for one step; T tokens of B sequences, S sampled rows.

    Sequence b owns rows query_start_loc[b]:query_start_loc[b+1] of the token tensors: the
    last q_len of its context_lens[b] tokens (decodes first, then prefill chunks).
    """

    input_ids: torch.Tensor  # int64[T]
    positions: torch.Tensor  # int64[T] position of each token in its sequence
    slot_mapping: torch.Tensor  # int64[T] KV slot (block_id * block_size + offset) of each token
    block_tables: torch.Tensor  # int32[B, max_blocks_per_seq] KV blocks of each sequence
    query_start_loc: torch.Tensor  # int32[B + 1] first row of each sequence, then T
    context_lens: torch.Tensor  # int32[B] tokens in each sequence's context after this step
    logits_indices: torch.Tensor  # int64[S] rows whose next-token logits are wanted

    @property
    def num_tokens(self) -> int:
        return int(self.input_ids.shape[0])

    @property
    def num_seqs(self) -> int:
        return int(self.context_lens.shape[0])

    def attention_metadata(self) -> AttentionMetadata:
        """The batch's layout as attention reads it."""
        return AttentionMetadata(self.block_tables, self.query_start_loc, self.context_lens,
                                 self.slot_mapping, self.num_tokens)
