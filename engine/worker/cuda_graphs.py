"""CUDA graphs for decode-only steps: one graph per padded batch size, static input buffers.

A decode step launches a few kernels per layer for a handful of tokens, so on a GPU its time
is mostly launch overhead; replaying a captured graph removes it. Graphs are captured lazily,
the first time a batch size bucket is needed, and share one memory pool. They read their
inputs from engine.graph_inputs.GraphInputs, which one host-to-device copy fills each step;
padding rows write no KV and their logits are dropped. Only used on CUDA; the CPU path never
imports CUDA APIs from here.

Decode steps with tokens on LoRA adapters replay graphs of their own (captured apart, so that a
step on the base model alone pays nothing for adapters): the Triton SGMV kernels read the
adapters from their fixed slot buffers and the step's tiles from the static inputs
(GraphInputs.lora_plan), a fixed number of programs whatever the mix of adapters.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.attention import AttentionBackend
from engine.models.decoder import CausalLM, KVCache
from engine.models.lora import LoraSlots
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
        lora: LoraSlots | None = None,
    ) -> None:
        """capture=False runs each step's forward eagerly over the same static buffers: the
        CPU tests' check of everything here but the capture itself. lora: the model's adapter
        slots, when they apply their updates with kernels (SlotKernels) a graph can hold."""
        assert lora is None or lora.kernels is not None
        self.model = model
        self.lora = lora
        self.capture = capture
        self.kv_caches = kv_caches
        self.attention = attention
        self.sizes = graph_batch_sizes(max_num_seqs)
        device = model.norm.weight.device
        self.inputs = GraphInputs(self.sizes[-1], max_blocks_per_seq, device)
        # (size, adapted) -> the graph, and its static logits [size, V]
        self.graphs: dict[tuple[int, bool], torch.cuda.CUDAGraph] = {}
        self.outputs: dict[tuple[int, bool], torch.Tensor] = {}
        self._first_graph: torch.cuda.CUDAGraph | None = None  # owner of the shared pool

    def can_run(self, inputs: StepInputs, adapted: bool = False) -> bool:
        """Decode-only (one token per sequence, each sampled), within the captured sizes;
        adapted (tokens on adapters): where the slots' kernels can be captured."""
        return (not adapted or self.lora is not None) and self.inputs.fits(inputs)

    def _forward(self, size: int, adapted: bool) -> torch.Tensor:
        """The model over the static rows :size; adapted: with the adapters' updates, over the
        static tiles."""
        batch = self.inputs.batch(size)
        if adapted:
            assert self.lora is not None
            self.lora.bind_plan(self.inputs.lora_plan(size, self.lora.num_slots))
        self.attention.prepare(batch.attention_metadata())
        try:
            out: torch.Tensor = self.model(batch, self.kv_caches, self.attention)
        finally:
            if adapted:
                assert self.lora is not None
                self.lora.bind(None)
        return out

    def _capture(self, size: int, adapted: bool) -> None:
        def forward() -> torch.Tensor:
            return self._forward(size, adapted)

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
            self.outputs[size, adapted] = forward()
        self._first_graph = self._first_graph or graph
        self.graphs[size, adapted] = graph

    def run(self, inputs: StepInputs, sampled_on_device: torch.Tensor | None,
            token_slots: np.ndarray | None = None) -> torch.Tensor:  # float32[B, V]
        """Load the step into the static buffers of the smallest fitting graph and replay;
        token_slots: each sequence's adapter slot (int64, -1: the base model) where the step
        has tokens on adapters (can_run(inputs, adapted=True))."""
        num_seqs = inputs.context_lens.size
        size = next(s for s in self.sizes if s >= num_seqs)
        adapted = token_slots is not None
        self.inputs.load(inputs, size, sampled_on_device, token_slots)
        if not self.capture:
            return self._forward(size, adapted)[:num_seqs]
        if (size, adapted) not in self.graphs:
            self._capture(size, adapted)
        self.graphs[size, adapted].replay()
        return self.outputs[size, adapted][:num_seqs]
