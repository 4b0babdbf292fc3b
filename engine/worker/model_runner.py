"""TorchModelRunner: runs a scheduled step of a real model over the paged KV cache.

One step is one forward over every scheduled token (decodes first, then prefill chunks) as a
single flat batch without padding; the lm_head runs only for the rows that sample, and the
sampler picks their next tokens. On CUDA, decode-only steps replay captured CUDA graphs.
"""

from __future__ import annotations

import concurrent.futures
import ctypes
from collections import Counter
from pathlib import Path
from typing import Protocol

import numpy as np
import torch

from engine.attention import attention_backend
from engine.config import EngineConfig, SchedulerConfig
from engine.device_copy import to_device_async
from engine.models.config import ModelConfig, ModelConfigError
from engine.models.cpu_decode import CpuDecodeForward, PanelEmbedding, PanelLinear
from engine.models.cpu_decode import lora_kernels as cpu_lora_kernels
from engine.models.cpu_decode import supports as supports_decode_forward
from engine.models.decoder import CausalLM, KVCache
from engine.models.loader import load_model, random_model
from engine.models.lora import LoraSlots, SlotKernels
from engine.models.packed_linear import pack_linear_layers
from engine.models.quantized import QuantizedLinear
from engine.models.quantized.panels import PanelFormat
from engine.sample.sampler import SampledTokens, Sampler
from engine.sample.sampling_table import SamplingColumns
from engine.scheduler_output import ScheduledChunk, SchedulerOutput
from engine.types import LoraRequest, RunnerStep
from engine.worker.batch_runner import BatchRunner
from engine.worker.cuda_graphs import DecodeCudaGraphs
from engine.worker.flops import FlopsCounter
from engine.worker.input_batch import RequestState, StepInputs
from engine.worker.kv_memory import (
    KVCacheSize,
    allocate_kv_tensor,
    kv_cache_dtype,
    kv_cache_size,
)
from engine.worker.lora_cache import LoraCache
from engine.worker.queued_step import StepEvents
from engine.worker.weight_format import weight_format_label

__all__ = [
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
        mallopt, malloc_trim = libc.mallopt, libc.malloc_trim
    except (OSError, AttributeError):
        return
    # First hand back what loading freed (a GGUF file's blocks repacked into panels left a
    # quarter of the panels' size in freed temporaries), which the thresholds below would keep.
    malloc_trim(0)
    m_trim_threshold, m_mmap_threshold = -1, -3
    mallopt(m_mmap_threshold, 32 << 20)  # glibc's maximum
    mallopt(m_trim_threshold, 1 << 30)


def _weight_bytes(model: torch.nn.Module) -> int:
    return sum(p.numel() * p.element_size() for p in model.parameters())


def _step_reserve_bytes(model: ModelConfig, sizes: SchedulerConfig, dtype: torch.dtype) -> int:
    """A bound on one step's activations, kept out of the KV cache's share: the widest
    per-token tensors of a full step (the MLP's gate and up, the residual, norms and
    attention's output) and the sampled rows' float32 logits, a few copies each."""
    element_size = torch.empty(0, dtype=dtype).element_size()
    per_token = (4 * model.hidden_size + 3 * model.intermediate_size) * element_size
    logits = sizes.max_num_seqs * model.vocab_size * 4 * 4
    return sizes.max_num_batched_tokens * per_token + logits


def kv_bytes_per_block(config: ModelConfig, block_size: int, dtype: torch.dtype) -> int:
    """Bytes one KV block takes over all layers, K and V."""
    element_size = torch.empty(0, dtype=dtype).element_size()
    return 2 * config.num_layers * block_size * config.kv_size * element_size


class TorchModelRunner(BatchRunner):
    """The ModelRunner of real models (engine.types.ModelRunner): the forward of a CausalLM
    over its paged KV cache, then the sampler."""

    def __init__(
        self, model: CausalLM, config: EngineConfig, sampler: TokenSampler | None = None
    ) -> None:
        """config: the engine's; the runner reads the sizes it shares with the scheduler
        (config.scheduler, config.cache.block_size) and its own options (config.runner)."""
        options, sizes, block_size = config.runner, config.scheduler, config.cache.block_size
        self.model = model
        self.model_config = model.config
        weight = model.norm.weight  # float in every model (the matrices may be quantized)
        device, self.dtype = weight.device, weight.dtype
        if sizes.max_model_len > model.max_positions:
            raise ModelConfigError("max_model_len exceeds the model's RoPE table")
        # the C++ decode forward reads float or GGUF panels, not QuantizedLinear's layouts
        has_quantized_linears = any(isinstance(m, QuantizedLinear) for m in model.modules())
        decodes_in_cpp = (device.type == "cpu" and options.cpu_decode_rows > 0
                          and not has_quantized_linears
                          and supports_decode_forward(self.model_config, device, self.dtype))
        # LoRA adapters: none of this costs a step that has no token on an adapter. Made before
        # the KV cache is sized: on CUDA the kernels' slot buffers take their memory first.
        self.lora: LoraCache | None = None
        if config.lora.max_loras > 0:
            kernels: SlotKernels | None = None
            if device.type == "cuda":  # SGMV: every slot's update in two launches a product
                from engine.models.triton_lora import TritonLoraStack

                kernels = TritonLoraStack.for_model(self.model_config, config.lora.max_loras,
                                                    config.lora.max_lora_rank, self.dtype,
                                                    device)
            elif decodes_in_cpp or (device.type == "cpu" and options.fuse_cpu_ops and
                                    supports_decode_forward(self.model_config, device,
                                                            self.dtype)):
                # the decode forward's kernels, and the layer path's updates in one call each
                kernels = cpu_lora_kernels(self.model_config, config.lora.max_loras)
            self.lora = LoraCache(self.model_config, config.lora, device, self.dtype, kernels)
            model.use_lora_slots(self.lora.slots)
        self.kv_dtype = kv_cache_dtype(options.kv_cache_dtype, device, self.dtype)
        per_block = kv_bytes_per_block(self.model_config, block_size, self.kv_dtype)
        num_blocks = options.num_kv_blocks
        self.kv_cache_size: KVCacheSize | None = None  # None: num_kv_blocks was given
        if num_blocks is None:
            self.kv_cache_size = kv_cache_size(
                device,
                requested_bytes=options.kv_cache_bytes,
                memory_fraction=options.kv_cache_memory_fraction,
                memory_scale=options.kv_cache_memory_scale,
                most_useful_bytes=sizes.max_num_seqs * per_block * -(
                    -sizes.max_model_len // block_size),
                reserve_bytes=_step_reserve_bytes(self.model_config, sizes, self.dtype)
                + (_weight_bytes(model) if decodes_in_cpp else 0),
            )
            num_blocks = self.kv_cache_size.num_bytes // per_block
        if num_blocks < 1:
            raise ModelConfigError("the KV cache budget holds no block")
        super().__init__(config, int(num_blocks), device)
        shape = (num_blocks, block_size, self.model_config.num_kv_heads,
                 self.model_config.head_dim)
        self.kv_caches: list[KVCache] = [
            (allocate_kv_tensor(shape, self.kv_dtype, device),
             allocate_kv_tensor(shape, self.kv_dtype, device))
            for _ in range(self.model_config.num_layers)
        ]
        self.decode_forward: CpuDecodeForward | None = None
        if device.type == "cpu":
            if options.tune_cpu_allocator:
                keep_freed_memory_in_heap()
            if decodes_in_cpp:  # before packing: it copies the plain weights
                self.decode_forward = CpuDecodeForward(model, self.kv_caches,
                                                       options.cpu_decode_rows)
                model.lm_head = self.decode_forward.lm_head_module()  # one copy, not two
            if options.pack_cpu_weights:
                pack_linear_layers(model, batch_size_hint=min(sizes.max_num_batched_tokens, 64))
            if options.fuse_cpu_ops:
                model.use_fused_cpu_ops()
        elif device.type == "cuda" and options.fuse_cuda_ops:
            model.use_fused_cuda_ops()
        self.attention = attention_backend(device)
        self.sampler: TokenSampler = sampler or Sampler(
            self.model_config.vocab_size, seed=options.sampler_seed
        )
        self._flops = FlopsCounter(self.model_config)
        self.graphs: DecodeCudaGraphs | None = None
        if options.use_cuda_graphs and device.type == "cuda":
            max_blocks_per_seq = -(-sizes.max_model_len // block_size)
            self.graphs = DecodeCudaGraphs(
                model, self.kv_caches, self.attention, sizes.max_num_seqs, max_blocks_per_seq,
                lora=self.lora.slots if self.lora is not None else None,
            )

    @property
    def weight_format(self) -> str:
        """The weights as served: their dtype, and the matrices held as stored by what they
        came from (a GGUF file's types, a quantized HF checkpoint's format), e.g.
        `float32; stored: Q4_1 x120, Q8_0 x1` or `bfloat16; stored: awq-int4-g128 x28`."""
        stored = {id(module.panels): module.panels.origin for module in self.model.modules()
                  if isinstance(module, PanelLinear | PanelEmbedding)
                  and module.panels.format is not PanelFormat.F32}
        stored |= {id(module): module.format.name for module in self.model.modules()
                   if isinstance(module, QuantizedLinear)}
        kinds = Counter(stored.values())
        described = ", ".join(f"{kind} x{count}" for kind, count in sorted(kinds.items()))
        dtype = str(self.dtype).removeprefix("torch.")
        return f"{dtype}; stored: {described}" if kinds else dtype

    @property
    def weight_format_label(self) -> str:
        """weight_format as a usage record's and a metric's label, e.g. `gguf-q4_1+q8_0`
        (engine.worker.weight_format)."""
        return weight_format_label(self.weight_format)

    @classmethod
    def from_model_dir(
        cls,
        model_dir: str | Path,
        config: EngineConfig,
        dtype: torch.dtype | None = None,
        device: torch.device | str = "cpu",
        sampler: TokenSampler | None = None,
    ) -> TorchModelRunner:
        """Load a HF checkpoint directory (config.json + safetensors)."""
        model = load_model(model_dir, dtype, device, config.scheduler.max_model_len)
        return cls(model, config, sampler)

    @classmethod
    def from_random(
        cls,
        model_config: ModelConfig,
        seed: int,
        config: EngineConfig,
        dtype: torch.dtype = torch.float32,
        device: torch.device | str = "cpu",
        sampler: TokenSampler | None = None,
    ) -> TorchModelRunner:
        """A model with seeded random weights (engine.loader.random_hf_state_dict)."""
        model = random_model(model_config, seed, dtype, device, config.scheduler.max_model_len)
        return cls(model, config, sampler)

    # -- ModelRunner ---------------------------------------------------------------------------

    def estimate_flops(
        self, num_new: np.ndarray, num_context: np.ndarray, num_sampled: np.ndarray
    ) -> np.ndarray:
        return self._flops.many(num_new, num_context, num_sampled)

    @property
    def runs_ahead(self) -> bool:
        return self.device.type == "cuda"

    def prepare_lora(self, lora: LoraRequest) -> concurrent.futures.Future[float]:
        """engine.types.ModelRunner.prepare_lora: read on the cache's loader thread."""
        if self.lora is None:
            refused: concurrent.futures.Future[float] = concurrent.futures.Future()
            refused.set_exception(ValueError("this engine serves no LoRA adapters "
                                             "(max_loras is 0)"))
            return refused
        return self.lora.prepare(lora)

    def release_lora(self, lora: LoraRequest) -> None:
        if self.lora is not None:
            self.lora.release(lora.name)

    def synchronize(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)

    @torch.inference_mode()
    def execute(self, scheduler_output: SchedulerOutput) -> RunnerStep:
        """BatchRunner.execute with autograd off; on CUDA all of it is queued."""
        return super().execute(scheduler_output)

    # -- BatchRunner ---------------------------------------------------------------------------

    def _forward_and_sample(
        self, chunks: list[ScheduledChunk], inputs: StepInputs, states: list[RequestState]
    ) -> SampledTokens:
        """One forward over every chunk (a captured CUDA graph for decode-only steps where one
        fits, adapters or not, the C++ decode forward on the CPU where it can, adapters or
        not), then the sampler."""
        input_batch = self.input_batch
        lora: LoraSlots | None = None  # the step's adapters, None: every token on the base
        if self.lora is not None:
            if input_batch.num_lora_requests:
                self.lora.bind_step(input_batch.chunk_loras(chunks),
                                    np.diff(inputs.query_start_loc))
                if self.lora.slots.active:
                    lora = self.lora.slots
            else:
                self.lora.slots.bind(None)
        graphs = self.graphs
        if graphs is not None and graphs.can_run(inputs, adapted=lora is not None):
            # Decode rows are the step's tokens: the slot of each token is its sequence's.
            logits = graphs.run(inputs, input_batch.sampled_on_device,
                                None if lora is None else lora.token_slots)
        else:
            batch = self._to_device(inputs)
            if self.decode_forward is not None and self.decode_forward.can_run(batch, lora):
                logits = self.decode_forward(batch, lora)
            else:
                self.attention.prepare(batch.attention_metadata())
                logits = self.model(batch, self.kv_caches, self.attention)  # [S, V]
        columns = input_batch.sampling_columns(inputs.sample_rows)
        return self.sampler.sample(logits, states, columns)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        src = to_device_async([s for s, _ in pairs], self.device)
        dst = to_device_async([d for _, d in pairs], self.device)
        for k_cache, v_cache in self.kv_caches:
            k_cache.index_copy_(0, dst, k_cache.index_select(0, src))
            v_cache.index_copy_(0, dst, v_cache.index_select(0, src))

    def _step_events(self) -> StepEvents | None:
        """On CUDA the device times the step."""
        if self.device.type != "cuda":
            return None
        events = (torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True))
        events[0].record()
        return events
