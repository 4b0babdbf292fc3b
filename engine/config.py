"""Typed configuration of the engine; validated once, plain values below it."""

from __future__ import annotations

from dataclasses import dataclass, field

from engine.errors import ConfigError
from engine.grammar_budget import GrammarBudget

__all__ = ["CPU_DECODE_MAX_ROWS", "CacheConfig", "ConfigError", "EngineConfig", "SchedulerConfig"]


# Most sequences a CPU decode step may run as one C++ call (engine.models.cpu_decode; the
# runner's `cpu_decode_rows` and `tiergate serve --cpu-decode-rows`): the default number of
# running requests, measured up to 48.
CPU_DECODE_MAX_ROWS = 64


@dataclass
class SchedulerConfig:
    max_num_batched_tokens: int = 2048  # token budget of one step (decodes + prefill chunks)
    max_num_seqs: int = 64  # requests running at once
    max_model_len: int = 4096  # prompt + output tokens of one request

    def validate(self) -> None:
        if self.max_num_batched_tokens < 1 or self.max_num_seqs < 1:
            raise ConfigError("max_num_batched_tokens and max_num_seqs must be >= 1")
        if self.max_model_len < 2:
            raise ConfigError("max_model_len must be >= 2")


@dataclass
class CacheConfig:
    block_size: int = 16  # tokens per KV block
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
class EngineConfig:
    scheduler: SchedulerConfig = field(default_factory=SchedulerConfig)
    cache: CacheConfig = field(default_factory=CacheConfig)
    eos_token_id: int | None = None  # ends a request unless ignore_eos
    # Schedule step N+1 while the device runs step N (its tokens feed N+1 on the device; stops
    # are found a step late). None: when the runner runs ahead of the host (CUDA).
    async_scheduling: bool | None = None
    # What a constrained sample's grammar may cost on the host before it ends with an error.
    grammar_budget: GrammarBudget = field(default_factory=GrammarBudget)

    def validate(self) -> None:
        self.scheduler.validate()
        self.cache.validate()
        self.grammar_budget.validate()
