"""Typed configuration of the engine; validated once, plain values below it."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import ConfigError
from engine.grammar_budget import GrammarBudget

__all__ = [
    "CPU_DECODE_MAX_ROWS",
    "KV_CACHE_DTYPES",
    "CacheConfig",
    "ConfigError",
    "EngineConfig",
    "LoraConfig",
    "RunnerConfig",
    "SchedulerConfig",
]


# Most sequences a CPU decode step may run as one C++ call (engine.models.cpu_decode; the
# runner's `cpu_decode_rows` and `tiergate serve --cpu-decode-rows`): the default number of
# running requests.
CPU_DECODE_MAX_ROWS = 64
# What the KV cache holds (RunnerConfig.kv_cache_dtype): auto, the model's activations' dtype;
# fp8, float8 E4M3, half of bfloat16's bytes (engine.worker.kv_memory.kv_cache_dtype).
KV_CACHE_DTYPES = ("auto", "fp8")


@dataclass
class SchedulerConfig:
    """Sizes of a step, read by the scheduler and the runner alike."""

    # Token budget of one step (decodes + prefill chunks); the runner sizes its activation
    # reserve by it.
    max_num_batched_tokens: int = 2048
    max_num_seqs: int = 64  # requests running at once (the runner's largest CUDA graph)
    # Prompt + output tokens of one request (the runner's RoPE table, CUDA graph block tables).
    max_model_len: int = 4096

    def validate(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ConfigError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.max_model_len < 2:
            raise ConfigError("max_model_len must be >= 2")


@dataclass
class CacheConfig:
    block_size: int = 16  # tokens per KV block, of the block pool and the runner's KV tensors
    enable_prefix_caching: bool = True
    # priority -> share of the KV pool reserved for that tier (usable by it and higher tiers)
    reserved_fractions: dict[int, float] = field(default_factory=dict)

    def validate(self) -> None:
        if self.block_size < 1:
            raise ConfigError("block_size must be >= 1")
        if any(f < 0 for f in self.reserved_fractions.values()):
            raise ConfigError("reserved fractions must be >= 0")
        if sum(self.reserved_fractions.values()) > 1.0:
            raise ConfigError("reserved fractions add up to more than the whole pool")

    def reserved_blocks(self, num_blocks: int) -> dict[int, int]:
        return {p: int(f * num_blocks) for p, f in self.reserved_fractions.items()}


@dataclass
class RunnerConfig:
    """What only the model runner reads; the sizes it shares with the scheduler (block size,
    step budget, sequences, context) are the EngineConfig's `scheduler` and `cache`."""

    num_kv_blocks: int | None = None  # KV blocks to allocate; None: derive from the budget
    # KV budget over all layers, K and V (when num_kv_blocks is None); None: a share of the
    # memory left once the model is loaded (engine.worker.kv_memory), kv_cache_memory_fraction
    # of it (None: the device's default)
    kv_cache_bytes: int | None = None
    kv_cache_memory_fraction: float | None = None
    # Multiplies that fraction (the given one or the default): where several engines share a
    # device, each takes its part (the gateway sets it; 1: this engine alone).
    kv_cache_memory_scale: float = 1.0
    kv_cache_dtype: str = "auto"  # auto (the model's dtype) or fp8 (engine.worker.kv_memory)
    use_cuda_graphs: bool = True  # capture decode-only steps on CUDA
    pack_cpu_weights: bool = True  # CPU: linear layers on oneDNN-prepacked weights
    # CPU float32: norms, RoPE + KV write, SiLU-and-mul, LoRA updates as C++ ops
    fuse_cpu_ops: bool = True
    # CPU float32: decode-only steps of at most this many sequences (up to
    # CPU_DECODE_MAX_ROWS) run as one C++ call (engine.models.cpu_decode; a second copy of the
    # weights); 0: never
    cpu_decode_rows: int = CPU_DECODE_MAX_ROWS
    fuse_cuda_ops: bool = True  # CUDA: residual add + RMSNorm as one Triton kernel
    tune_cpu_allocator: bool = True  # CPU: keep freed memory in the heap (process-wide mallopt)
    sampler_seed: int | None = None  # seed of the sampler's generator for unseeded requests


@dataclass
class LoraConfig:
    """LoRA adapters: how many one step may mix (the runner's device slots, a resource the
    scheduler allots next to KV blocks), how many the runner keeps loaded on the host, and
    the largest rank it takes."""

    max_loras: int = 4  # distinct adapters in one step (device slots); 0: no adapters served
    max_cpu_loras: int = 16  # adapters kept loaded on the host (LRU; pinned ones never evicted)
    max_lora_rank: int = 64

    def validate(self) -> None:
        if self.max_loras < 0 or self.max_lora_rank < 1:
            raise ConfigError("max_loras must be >= 0 and max_lora_rank >= 1")
        if self.max_cpu_loras < self.max_loras:
            raise ConfigError("max_cpu_loras must be at least max_loras")


@dataclass
class EngineConfig:
    """The one configuration of an engine: its scheduler and its runner read the same."""

    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    eos_token_id: int | None = None  # ends a request unless ignore_eos
    # Schedule step N+1 while the device runs step N (its tokens feed N+1 on the device; stops
    # are found a step late). None: when the runner runs ahead of the host (CUDA).
    async_scheduling: bool | None = None
    # What a constrained sample's grammar may cost on the host before it ends with an error.
    grammar_budget: GrammarBudget = field(default_factory=GrammarBudget)
    runner: RunnerConfig = field(default_factory=RunnerConfig)  # the runner's own options
    lora: LoraConfig = field(default_factory=LoraConfig)  # adapter slots (scheduler, runner)

    def validate(self) -> None:
        self.scheduler.validate()
        self.lora.validate()
        self.cache.validate()
        self.grammar_budget.validate()
