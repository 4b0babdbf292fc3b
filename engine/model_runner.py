"""TorchModelRunner: runs a scheduled step of a real model over the paged KV cache.

One step is one forward over every scheduled token (decodes first, then prefill chunks) as a
single flat batch without padding; the lm_head runs only for the rows that sample, and the
sampler picks their next tokens. On CUDA, decode-only steps replay captured CUDA graphs.
"""

from __future__ import annotations

import ctypes
from dataclasses import dataclass
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from engine.attention import AttentionMetadata, attention_backend
from engine.cuda_graphs import DecodeCudaGraphs
from engine.device_copy import to_device_async
from engine.flops import FlopsCounter
from engine.input_batch import InputBatch, RequestState
from engine.kv_memory import KVCacheSize, allocate_kv_tensor, kv_cache_size
from engine.loader import load_model, random_model
from engine.models.config import ModelConfig, ModelConfigError
from engine.models.cpu_decode import MAX_ROWS as CPU_DECODE_MAX_ROWS
from engine.models.cpu_decode import CpuDecodeForward
from engine.models.cpu_decode import supports as supports_decode_forward
from engine.models.decoder import CausalLM, KVCache
from engine.models.packed_linear import pack_linear_layers
from engine.queued_step import QueuedStep
from engine.runner import FinishedStep, ModelRunnerOutput, RunnerStep
from engine.sampler import SampledTokens, Sampler
from engine.sampling_table import SamplingColumns
from engine.scheduler_output import SchedulerOutput

__all__ = [
    "RunnerConfig",
    "TokenSampler",
    "TorchModelRunner",
    "keep_freed_memory_in_heap",
    "kv_bytes_per_block",
]

class TokenSampler(Protocol):
    """Picks the next tokens (engine.sampler.Sampler, or a test's wrapper of it)."""

    def sample(self, logits: torch.Tensor, states: list[RequestState],
               columns: SamplingColumns | None = None) -> SampledTokens:
        """logits float32[S, V] and the requests that sample, in the same order, with their
        sampling parameters (None: read from the states)."""
        ...


@dataclass
class RunnerConfig:
    """How the runner sizes its KV cache and batches."""

    block_size: int = 16  # tokens per KV block
    num_kv_blocks: int | None = None  # KV blocks to allocate; None: derive from the budget
    # KV budget over all layers, K and V (when num_kv_blocks is None); None: a share of the
    # memory left once the model is loaded (engine.kv_memory), kv_cache_memory_fraction
    # of it (None: the device's default)
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    max_num_batched_tokens: int = 2048  # most tokens one step may carry
    max_num_seqs: int = 64  # most sequences one step may carry (largest CUDA graph)
    max_model_len: int = 4096  # longest sequence (RoPE table, CUDA graph block tables)
    use_cuda_graphs: bool = True  # capture decode-only steps on CUDA
    pack_cpu_weights: bool = True  # CPU: linear layers on oneDNN-prepacked weights
    fuse_cpu_ops: bool = True  # CPU float32: norms, RoPE + KV write, SiLU-and-mul as C++ ops
    # CPU float32: decode-only steps of at most this many sequences (up to 64) run as one C++
    # call (engine.models.cpu_decode; a second copy of the weights); 0: never
    cpu_decode_rows: int = CPU_DECODE_MAX_ROWS
    fuse_cuda_ops: bool = True  # CUDA: residual add + RMSNorm as one Triton kernel
    tune_cpu_allocator: bool = True  # CPU: keep freed memory in the heap (process-wide mallopt)
    sampler_seed: int | None = None  # seed of the sampler's generator for unseeded requests


def keep_freed_memory_in_heap() -> None:
    """glibc: serve large temporaries from the heap instead of fresh mmaps.

    By default glibc maps every allocation above its mmap threshold (128 KiB, rising to at most
    32 MiB) afresh and unmaps it on free, so every step's activations and K/V gathers fault in
    zeroed pages again; on a 2-core CPU that doubled the step time. Raising the mmap and trim
    thresholds keeps freed memory for reuse (the process keeps its peak heap). Process-wide; a
    no-op where glibc is absent.
    """
    try:
        libc = ctypes.CDLL("libc.so.6")
        mallopt = libc.mallopt
    except (OSError, AttributeError):
        return
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum
    mallopt(m_trim_threshold, 1 << 30)


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _step_reserve_bytes(model: ModelConfig, config: RunnerConfig, dtype: torch.dtype) -> int:
    """A bound on one step's activations, kept out of the KV cache's share: the widest
    per-token tensors of a full step (the MLP's gate and up, the residual, norms and
    attention's output) and the sampled rows' float32 logits, a few copies each."""
    element_size = torch.empty(0, dtype=dtype).element_size()
    per_token = (4 * model.hidden_size + 3 * model.intermediate_size) * element_size
    logits = config.max_num_seqs * model.vocab_size * 4 * 4
    return config.max_num_batched_tokens * per_token + logits


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes over all layers, K and V."""
    element_size = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.kv_size * element_size


class TorchModelRunner:
    """The ModelRunner of real models (engine.runner.ModelRunner).

    Keeps the requests it runs in an InputBatch (engine.input_batch): a request's tokens and
    block table come once, then only what changed, and the tokens it samples stay here.
    """

    def __init__(
        self, model: CausalLM, config: RunnerConfig, sampler: TokenSampler | None = None
    ) -> None:
        self.model = model
        self.config = config
        self.model_config = model.config
        weight = model.embed_tokens.weight
        self.device, self.dtype = weight.device, weight.dtype
        if config.max_model_len > model.max_positions:
            raise ModelConfigError("max_model_len exceeds the model's RoPE table")
        decodes_in_cpp = (self.device.type == "cpu" and config.cpu_decode_rows > 0
                          and supports_decode_forward(self.model_config, self.device,
                                                      self.dtype))
        per_block = kv_bytes_per_block(self.model_config, config.block_size, self.dtype)
        num_blocks = config.num_kv_blocks
        self.kv_cache_size: KVCacheSize | None = None  # None: num_kv_blocks was given
        if num_blocks is None:
            self.kv_cache_size = kv_cache_size(
                self.device,
                requested_bytes=config.kv_cache_bytes,
                memory_fraction=config.kv_cache_memory_fraction,
                most_useful_bytes=config.max_num_seqs * per_block * -(
                    -config.max_model_len // config.block_size),
                reserve_bytes=_step_reserve_bytes(self.model_config, config, self.dtype)
                + (_weight_bytes(model) if decodes_in_cpp else 0),
            )
            num_blocks = self.kv_cache_size.num_bytes // per_block
        if num_blocks < 1:
            raise ModelConfigError("the KV cache budget holds no block")
        self._num_kv_blocks = int(num_blocks)
        shape = (num_blocks, config.block_size, self.model_config.num_kv_heads,
                 self.model_config.head_dim)
        self.kv_caches: list[KVCache] = [
            (allocate_kv_tensor(shape, self.dtype, self.device),
             allocate_kv_tensor(shape, self.dtype, self.device))
            for _ in range(self.model_config.num_layers)
        ]
        self.decode_forward: CpuDecodeForward | None = None
        if self.device.type == "cpu":
            if config.tune_cpu_allocator:
                keep_freed_memory_in_heap()
            if decodes_in_cpp:  # before packing: it copies the plain weights
                self.decode_forward = CpuDecodeForward(model, self.kv_caches,
                                                       config.cpu_decode_rows)
                model.lm_head = self.decode_forward.lm_head_module()  # one copy, not two
            if config.pack_cpu_weights:
                pack_linear_layers(model, batch_size_hint=min(config.max_num_batched_tokens, 64))
            if config.fuse_cpu_ops:
                model.use_fused_cpu_ops()
        elif self.device.type == "cuda" and config.fuse_cuda_ops:
            model.use_fused_cuda_ops()
        self.attention = attention_backend(self.device)
        self.sampler: TokenSampler = sampler or Sampler(
            self.model_config.vocab_size, seed=config.sampler_seed
        )
        self._flops = FlopsCounter(self.model_config)
        self.input_batch = InputBatch(config.block_size, config.max_num_seqs,
                                      config.max_model_len)
        self.graphs: DecodeCudaGraphs | None = None
        if config.use_cuda_graphs and self.device.type == "cuda":
            max_blocks_per_seq = -(-config.max_model_len // config.block_size)
            self.graphs = DecodeCudaGraphs(
                model, self.kv_caches, self.attention, config.max_num_seqs, max_blocks_per_seq
            )

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        config: RunnerConfig,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        sampler: TokenSampler | None = None,
    ) -> TorchModelRunner:
        """Load a HF checkpoint directory (config.json + safetensors)."""
        model = load_model(model_dir, dtype, device, config.max_model_len)
        return cls(model, config, sampler)

    @classmethod
    def from_random(
        cls,
        model_config: ModelConfig,
        seed: int,
        config: RunnerConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        sampler: TokenSampler | None = None,
    ) -> TorchModelRunner:
        """A model with seeded random weights (engine.loader.random_hf_state_dict)."""
        model = random_model(model_config, seed, dtype, device, config.max_model_len)
        return cls(model, config, sampler)

    # -- ModelRunner ---------------------------------------------------------------------------

    @property
    def num_kv_blocks(self) -> int:
        return self._num_kv_blocks

    @property
    def block_size(self) -> int:
        return self.config.block_size

    def estimate_flops(
        self, num_new: np.ndarray, num_context: np.ndarray, num_sampled: np.ndarray
    ) -> np.ndarray:
        return self._flops.many(num_new, num_context, num_sampled)

    @property
    def runs_ahead(self) -> bool:
        return self.device.type == "cuda"

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerStep:
        """Copy blocks, then one forward over every chunk, then sample the chunks that ask;
        on CUDA all of it is queued, and the sampled tokens come back without a wait."""
        input_batch = self.input_batch
        input_batch.update(scheduler_output)
        chunks = scheduler_output.chunks
        if not chunks:
            if scheduler_output.blocks_to_copy:
                self._copy_blocks(scheduler_output.blocks_to_copy)
            return FinishedStep(ModelRunnerOutput(sampled_token_ids={}))
        events = None
        if self.device.type == "cuda":
            events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
            events[0].record()
        if scheduler_output.blocks_to_copy:
            self._copy_blocks(scheduler_output.blocks_to_copy)
        inputs = input_batch.prepare(chunks)
        if self.graphs is not None and self.graphs.can_run(inputs):
            logits = self.graphs.run(inputs, input_batch.sampled_on_device)
        else:
            batch = inputs.to_device(self.device, input_batch.sampled_on_device)
            if self.decode_forward is not None and self.decode_forward.can_run(batch):
                logits = self.decode_forward(batch)
            else:
                self.attention.prepare(AttentionMetadata.from_batch(batch))
                logits = self.model(batch, self.kv_caches, self.attention)  # [S, V]
        states = input_batch.sample_states(chunks)
        columns = input_batch.sampling_columns(inputs.sample_rows)
        sampled = self.sampler.sample(logits, states, columns)
        pending = input_batch.mark_sampled(states, sampled.token_ids, inputs.sample_rows)
        step = QueuedStep(input_batch, pending, sampled.to_host(), events)
        if events is not None:
            events[1].record()
        return step

    # -- helpers -------------------------------------------------------------------------------

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = to_device_async([s for s, _ in pairs], self.device)
        dst = to_device_async([d for _, d in pairs], self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
            v_cache.index_copy_(0, dst, v_cache.index_select(0, src))

