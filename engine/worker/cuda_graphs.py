"""CUDA graphs for decode-only steps: one graph per padded batch size, static input buffers.

A decode step launches a few kernels per layer for a handful of tokens, so on a GPU its time
is mostly launch overhead; replaying a captured graph removes it. Graphs are captured lazily,
the first time a batch size bucket is needed, and share one memory pool. They read their
inputs from engine.graph_inputs.GraphInputs, which one host-to-device copy fills each step;
padding rows write no KV and their logits are dropped. Only used on CUDA; the CPU path never
imports CUDA APIs from here.
"""

from __future__ import annotations

import torch

from engine.attention import AttentionBackend
from engine.models.decoder import CausalLM, KVCache
from engine.worker.graph_inputs import GraphInputs
from engine.worker.input_batch import StepInputs

__all__ = ["DecodeCudaGraphs", "graph_batch_sizes"]


def graph_batch_sizes(max_num_seqs: int) -> list[int]:
    """1, 2, 4, 8, then multiples of 8 up to max_num_seqs (vLLM's buckets)."""
    sizes = {s for s in (1, 2, 4) if s < max_num_seqs}
    sizes.update(range(8, max_num_seqs, 8))
    sizes.add(max_num_seqs)
    return sorted(sizes)


class DecodeCudaGraphs:
    """Captured forwards of decode-only batches, replayed after the step's inputs are loaded."""

    def __init__(
        self,
        model: CausalLM,
        kv_caches: list[KVCache],
        attention: AttentionBackend,
        max_num_seqs: int,
        max_blocks_per_seq: int,
        capture: bool = True,
    ) -> None:
        """capture=False runs each step's forward eagerly over the same static buffers: the
        CPU tests' check of everything here but the capture itself."""
        self.model = model
        self.capture = capture
        self.kv_caches = kv_caches
        self.attention = attention
        self.sizes = graph_batch_sizes(max_num_seqs)
        device = model.embed_tokens.weight.device
        self.inputs = GraphInputs(self.sizes[-1], max_blocks_per_seq, device)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}  # size -> static logits [size, V]
        self._first_graph: torch.cuda.CUDAGraph | None = None  # owner of the shared pool

    def can_run(self, inputs: StepInputs) -> bool:
        """Decode-only (one token per sequence, each sampled), within the captured sizes."""
        return self.inputs.fits(inputs)

    def _capture(self, size: int) -> None:
        batch = self.inputs.batch(size)

        def forward() -> torch.Tensor:
            self.attention.prepare(batch.attention_metadata())
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

    def run(self, inputs: StepInputs,
            sampled_on_device: torch.Tensor | None) -> torch.Tensor:  # float32[B, V]
        """Load the step into the static buffers of the smallest fitting graph and replay."""
        num_seqs = inputs.context_lens.size
        size = next(s for s in self.sizes if s >= num_seqs)
        self.inputs.load(inputs, size, sampled_on_device)
        if not self.capture:
            batch = self.inputs.batch(size)
            self.attention.prepare(batch.attention_metadata())
            logits: torch.Tensor = self.model(batch, self.kv_caches, self.attention)
            return logits[:num_seqs]
        if size not in self.graphs:
            self._capture(size)
        self.graphs[size].replay()
        return self.outputs[size][:num_seqs]
