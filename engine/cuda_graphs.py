"""CUDA graphs for decode-only steps: one graph per padded batch size, static input buffers.

A decode step launches a few kernels per layer for a handful of tokens, so on a GPU its time
is mostly launch overhead; replaying a captured graph removes it. Graphs are captured lazily,
the first time a batch size bucket is needed, and share one memory pool. Padding rows write
to slot -1 (skipped by write_kv) and attend over a one-token context in block 0; their logits
are dropped. Only used on CUDA; the CPU path never imports CUDA APIs from here.
"""

from __future__ import annotations

import torch

from engine.attention import AttentionBackend, AttentionMetadata
from engine.models.batch import ForwardBatch
from engine.models.decoder import CausalLM, KVCache
from engine.scheduler_output import ScheduledChunk

__all__ = ["DecodeCudaGraphs", "graph_batch_sizes"]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to max_num_seqs (vLLM's buckets)."""
    sizes = {s for s in (1, 2, 4) if s < max_num_seqs}
    sizes.update(range(8, max_num_seqs, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


class DecodeCudaGraphs:
    """Captured forwards of decode-only batches, replayed with the step's inputs copied in."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[KVCache],
        attention: AttentionBackend,
        max_num_seqs: int,
        max_blocks_per_seq: int,
    ) -> None:
        self.model = model
        self.kv_caches = kv_caches
        self.attention = attention
        self.max_blocks_per_seq = max_blocks_per_seq
        self.sizes = graph_batch_sizes(max_num_seqs)
        device = model.embed_tokens.weight.device
        n = self.sizes[-1]
        # Static inputs, sliced per graph size; a replay reads whatever they hold.
        self.input_ids = torch.zeros(n, dtype=torch.int64, device=device)
        self.positions = torch.zeros(n, dtype=torch.int64, device=device)
        self.slot_mapping = torch.full((n,), -1, dtype=torch.int64, device=device)
        self.block_tables = torch.zeros(n, max_blocks_per_seq, dtype=torch.int32, device=device)
        self.query_start_loc = torch.arange(n + 1, dtype=torch.int32, device=device)
        self.context_lens = torch.ones(n, dtype=torch.int32, device=device)
        self.logits_indices = torch.arange(n, dtype=torch.int64, device=device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # size -> static logits [size, V]
        self._first_graph: torch.cuda.CUDAGraph | None = None  # owner of the shared pool

    def can_run(self, chunks: list[ScheduledChunk], batch: ForwardBatch) -> bool:
        """Decode-only (one token per sequence, each sampled), within the captured sizes."""
        return (
            batch.num_tokens == batch.num_seqs <= self.sizes[-1]
            and all(c.needs_sample for c in chunks)
            and batch.block_tables.shape[1] <= self.max_blocks_per_seq
        )

    def _static_batch(self, size: int) -> ForwardBatch:
        return ForwardBatch(
            input_ids=self.input_ids[:size],
            positions=self.positions[:size],
            slot_mapping=self.slot_mapping[:size],
            block_tables=self.block_tables[:size],
            query_start_loc=self.query_start_loc[: size + 1],
            context_lens=self.context_lens[:size],
            logits_indices=self.logits_indices[:size],
        )

    def _capture(self, size: int) -> None:
        batch = self._static_batch(size)

        def forward() -> torch.Tensor:
            self.attention.prepare(AttentionMetadata.from_batch(batch))
            out: torch.Tensor = self.model(batch, self.kv_caches, self.attention)
            return out

        # Warm up on a side stream (lazy initialisation, Triton autotuning), then capture.
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(stream):
            for _ in range(2):
                forward()
        torch.cuda.current_stream().wait_stream(stream)
        graph = torch.cuda.CUDAGraph()
        pool = None if self._first_graph is None else self._first_graph.pool()
        with torch.cuda.graph(graph, pool=pool):
            self.outputs[size] = forward()
        self._first_graph = self._first_graph or graph
        self.graphs[size] = graph

    def run(self, batch: ForwardBatch) -> torch.Tensor:  # float32[B, V]
        """Copy the batch into the static buffers of the smallest fitting graph and replay."""
        num_seqs = batch.num_seqs
        size = next(s for s in self.sizes if s >= num_seqs)
        width = batch.block_tables.shape[1]
        self.input_ids[:num_seqs].copy_(batch.input_ids)
        self.positions[:num_seqs].copy_(batch.positions)
        self.slot_mapping[:num_seqs].copy_(batch.slot_mapping)
        self.block_tables[:num_seqs, :width].copy_(batch.block_tables)
        self.context_lens[:num_seqs].copy_(batch.context_lens)
        # Padding rows: no KV write, a one-token context in block 0.
        self.slot_mapping[num_seqs:size].fill_(-1)
        self.context_lens[num_seqs:size].fill_(1)
        self.block_tables[num_seqs:size].zero_()
        if size not in self.graphs:
            self._capture(size)
        self.graphs[size].replay()
        return self.outputs[size][:num_seqs]
