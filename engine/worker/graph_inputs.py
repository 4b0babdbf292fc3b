"""GraphInputs: the static buffers captured decode graphs read, filled by one copy per step.

A captured CUDA graph reads its inputs at fixed device addresses. Every input of a decode step
(token ids, positions, KV slots, context lengths, block tables, and where the tokens still on
the device go) lives in one device buffer, in a fixed byte layout. The host writes a step's
inputs into a staging buffer with the same layout (pinned on CUDA; two in turn, so that a step
never overwrites one whose copy may still be queued), and one host-to-device copy moves them:
no second copy on the device, no per-field kernels. A token whose id is still on the device
(async scheduling) is then taken from the previous step's sampled tensor with one scatter.

A step with tokens on LoRA adapters also writes its tiles (engine.models.lora_tiles, of
GRAPH_BLOCK_M tokens) into fields of the same buffer, which the adapted graphs' kernels read;
tiles past the step's own have no tokens.

Rows past the step's, up to the graph's size, are padding: they write no KV (slot -1) and
attend over a one-token context in block 0, on no adapter; their logits are dropped. The
query starts and logits rows of a decode graph never change (one token per sequence) and are
not copied.
Device-agnostic: on the CPU the same layout and copy run (the tests' check of the arithmetic).
"""

from __future__ import annotations

import numpy as np
import torch

from engine.models.batch import ForwardBatch
from engine.models.lora_tiles import GRAPH_BLOCK_M, LoraTokenPlan, graph_tiles, tile_tokens
from engine.worker.input_batch import StepInputs

__all__ = ["GraphInputs"]

# Fields copied each step, in layout order: int64 fields of max_num_seqs entries, then int32.
_INT64_FIELDS = ("input_ids", "positions", "slot_mapping", "pending_tokens", "pending_sources")
_LORA_FIELDS = ("lora_order", "lora_tile_slot", "lora_tile_start", "lora_tile_len")
_INT32_FIELDS = ("context_lens", *_LORA_FIELDS, "block_tables")


class _Staging:
    """A host buffer in the device buffer's layout, with numpy views of its fields."""

    def __init__(self, num_bytes: int, offsets: dict[str, tuple[int, int]],
                 pinned: bool) -> None:
        self.buffer = torch.zeros(num_bytes, dtype=torch.uint8, pin_memory=pinned)
        data = self.buffer.numpy()
        self.fields: dict[str, np.ndarray] = {}
        for name, (start, end) in offsets.items():
            self.fields[name] = data[start:end].view(np.int32 if name in _INT32_FIELDS
                                                     else np.int64)
        # Recorded after the copy that reads this buffer; waited on before writing it again.
        self.copied: torch.cuda.Event | None = torch.cuda.Event() if pinned else None


class GraphInputs:
    """Static decode inputs for up to max_num_seqs sequences of up to max_blocks_per_seq
    blocks, on device."""

    def __init__(self, max_num_seqs: int, max_blocks_per_seq: int,
                 device: torch.device) -> None:
        n, width = max_num_seqs, max_blocks_per_seq
        self.max_num_seqs = n
        self.max_blocks_per_seq = width
        sizes = {name: n * 8 for name in _INT64_FIELDS}
        sizes.update(context_lens=n * 4, block_tables=n * width * 4)
        sizes.update({name: n * 4 for name in _LORA_FIELDS})  # tiles <= tokens <= n
        self._offsets: dict[str, tuple[int, int]] = {}
        start = 0
        for name in _INT64_FIELDS + _INT32_FIELDS:
            self._offsets[name] = (start, start + sizes[name])
            start += sizes[name]
        self._buffer = torch.zeros(start, dtype=torch.uint8, device=device)
        self._fields: dict[str, torch.Tensor] = {
            name: self._buffer[begin:end].view(torch.int32 if name in _INT32_FIELDS
                                               else torch.int64)
            for name, (begin, end) in self._offsets.items()
        }
        self._fields["block_tables"] = self._fields["block_tables"].view(n, width)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=device)
        pinned = device.type == "cuda"
        self._staging = [_Staging(start, self._offsets, pinned) for _ in range(2 if pinned else 1)]
        self.num_loads = 0  # steps loaded so far
        self.fill_padding()

    def fits(self, inputs: StepInputs) -> bool:
        """A decode step (one token per sequence, each sampled) within the capacity."""
        num_seqs = inputs.context_lens.size
        return (inputs.input_ids.size == inputs.logits_indices.size == num_seqs
                <= self.max_num_seqs
                and inputs.block_tables.shape[1] <= self.max_blocks_per_seq)

    def batch(self, size: int) -> ForwardBatch:
        """The first size rows of the static buffers (what a graph of that size reads)."""
        fields = self._fields
        return ForwardBatch(
            input_ids=fields["input_ids"][:size],
            positions=fields["positions"][:size],
            slot_mapping=fields["slot_mapping"][:size],
            block_tables=fields["block_tables"][:size],
            query_start_loc=self.query_start_loc[: size + 1],
            context_lens=fields["context_lens"][:size],
            logits_indices=self.logits_indices[:size],
        )

    def fill_padding(self) -> None:
        """Every row padding (before capture: a graph's first run reads valid inputs)."""
        fields = self._fields
        fields["input_ids"].zero_()
        fields["positions"].zero_()
        fields["slot_mapping"].fill_(-1)
        fields["context_lens"].fill_(1)
        fields["block_tables"].zero_()
        for name in _LORA_FIELDS:
            fields[name].zero_()  # no tile has tokens

    def lora_plan(self, size: int, num_slots: int) -> LoraTokenPlan:
        """The tiles an adapted graph of size rows reads (engine.models.triton_lora): a fixed
        number, graph_tiles(size, num_slots), over these buffers."""
        fields, tiles = self._fields, graph_tiles(size, num_slots)
        return LoraTokenPlan(size, GRAPH_BLOCK_M, tiles, fields["lora_order"][:size],
                             fields["lora_tile_slot"][:tiles], fields["lora_tile_start"][:tiles],
                             fields["lora_tile_len"][:tiles])

    def load(self, inputs: StepInputs, size: int,
             sampled_on_device: torch.Tensor | None,
             token_slots: np.ndarray | None = None) -> None:
        """The step's inputs (fits(inputs)) into rows :size, padding past its sequences; the
        pending input ids taken from sampled_on_device (the previous step's sampled ids);
        token_slots: each sequence's LoRA slot (int64, -1: the base model), for an adapted
        graph, whose tiles are written too."""
        num_seqs = inputs.context_lens.size
        assert self.fits(inputs) and num_seqs <= size <= self.max_num_seqs, "does not fit"
        staging = self._staging[self.num_loads % len(self._staging)]
        self.num_loads += 1
        if staging.copied is not None:
            staging.copied.synchronize()  # its last copy has run (long ago, as a rule)
        host = staging.fields
        host["input_ids"][:num_seqs] = inputs.input_ids
        host["input_ids"][num_seqs:size] = 0
        host["positions"][:num_seqs] = inputs.positions
        host["positions"][num_seqs:size] = 0
        host["slot_mapping"][:num_seqs] = inputs.slot_mapping
        host["slot_mapping"][num_seqs:size] = -1
        host["context_lens"][:num_seqs] = inputs.context_lens
        host["context_lens"][num_seqs:size] = 1
        tables = host["block_tables"].reshape(self.max_num_seqs, self.max_blocks_per_seq)
        width = inputs.block_tables.shape[1]
        # Entries past a row's blocks are never read (its context length bounds them).
        tables[:num_seqs, :width] = inputs.block_tables
        tables[num_seqs:size, 0] = 0
        if token_slots is not None:
            assert token_slots.size == num_seqs
            order, tiles, _ = tile_tokens(token_slots, GRAPH_BLOCK_M)
            num_tiles = tiles.shape[1]
            host["lora_order"][: order.size] = order
            for name, row in zip(_LORA_FIELDS[1:], tiles, strict=True):
                host[name][:num_tiles] = row
                host[name][num_tiles:size] = 0  # no tokens: those programs return
        num_pending = inputs.pending_tokens.size
        host["pending_tokens"][:num_pending] = inputs.pending_tokens
        host["pending_sources"][:num_pending] = inputs.pending_sources
        # One copy: everything up to the end of row size - 1 of the block tables.
        end = self._offsets["block_tables"][0] + size * self.max_blocks_per_seq * 4
        self._buffer[:end].copy_(staging.buffer[:end], non_blocking=True)
        if staging.copied is not None:
            staging.copied.record()
        if num_pending:
            assert sampled_on_device is not None, "pending tokens need the sampled tensor"
            fields = self._fields
            input_ids = fields["input_ids"]
            input_ids[fields["pending_tokens"][:num_pending]] = (
                sampled_on_device[fields["pending_sources"][:num_pending]]
            )
