"""A model this replica serves: checkpoint, tokenizer and the engine running it (in a
process of its own). What --model names is resolved by `gateway.server.model_source` (with
none, the default model, SmolLM2-135M-Instruct, converted once from its GGUF file); each
served model's own settings are its `ModelSpec`.
"""

from __future__ import annotations

import functools
import logging
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import (
    CacheConfig,
    EngineClient,
    EngineConfig,
    EngineProcess,
    FCFSPolicy,
    GGUFCheckpoint,
    GrammarBudget,
    GrammarCompiler,
    LLMEngine,
    LoraConfig,
    ModelConfig,
    ModelRunner,
    RunnerConfig,
    SchedulerConfig,
    SchedulingPolicy,
    TenantContext,
    Tokenizer,
    TorchModelRunner,
    load_gguf_model,
)
from gateway.openai.chat_template import ChatTokenizer
from gateway.openai.tool_calls import ToolCallFormat, format_for_template
from gateway.server.model_source import resolve_model
from gateway.server.model_spec import ModelSpec
from gateway.server.settings import GatewaySettings
from policies import TieredPolicy, TieredPolicyConfig, TierTable

logger = logging.getLogger(__name__)

# --dtype: auto (None) serves a GGUF file's matrices as stored (gateway.server.model_source)
_DTYPES: dict[str, torch.dtype | None] = {
    "auto": None, "float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16,
}


@dataclass(frozen=True)
class ServedModel:
    """What the HTTP layer needs to know about the model, besides the engine itself."""

    # The id of /v1/models and of the `model` field clients send.
    name: str
    # The engine's tokenizer, with chat prompts rendered from the model's template.
    tokenizer: ChatTokenizer
    # Token ids that end a generation (config eos ids and the tokenizer's eos).
    eos_token_ids: tuple[int, ...]
    vocab_size: int
    # Longest prompt + output one request may have.
    max_model_len: int
    # Unix time the model was loaded (the `created` of /v1/models).
    created: int
    num_kv_blocks: int
    kv_block_size: int
    # How the model writes tool calls (--tool-call-parser, or guessed from its template).
    tool_format: ToolCallFormat
    # Checks structured outputs against the tokenizer before any engine work (its own
    # compiler: the engine's is in the engine's process).
    grammars: GrammarCompiler
    # The checkpoint's config: what a LoRA adapter is checked against before it is stored.
    model_config: ModelConfig
    # The weights as its engine serves them (`float32`, `gguf-q4_1+q8_0`: the engine's
    # ModelRunner.weight_format_label): its usage records' weight_format and its metric label.
    weight_format: str


def context_length(settings: GatewaySettings, model_config: ModelConfig,
                   spec: ModelSpec) -> int:
    """Longest prompt + output: the model's max_model_len, else --max-model-len, at most what
    the model was trained for."""
    return min(
        spec.max_model_len or settings.max_model_len or model_config.max_position_embeddings,
        model_config.max_position_embeddings,
    )


def load_served_model(
    settings: GatewaySettings, tiers: TierTable, spec: ModelSpec, created: int
) -> tuple[ServedModel, EngineClient]:
    """Start the model's engine in a process of its own (`EngineProcess`), which loads the
    checkpoint; returns once it is loaded."""
    source = resolve_model(
        spec.source, settings.model_cache_dir, settings.demo_model_dir,
        _DTYPES[spec.dtype or settings.dtype]
    )
    model_dir = source.model_dir
    model_config = ModelConfig.from_file(model_dir)
    tokenizer = ChatTokenizer.from_dir(model_dir)
    engine = EngineProcess(functools.partial(build_engine, settings, tiers, spec, model_dir,
                                             source.gguf_file))
    name = spec.served_name
    served = describe_model(model_config, tokenizer, name, created, engine,
                            tool_call_parser=settings.tool_call_parser)
    served.grammars.warm_up()  # the tokenizer's index, before the first structured request
    logger.info(
        "serving %s from %s on %s: %s weights, %d KV blocks of %d tokens, context %d, async "
        "scheduling %s (engine process %s)",
        name, model_dir, spec.device or settings.device, served.weight_format,
        served.num_kv_blocks, served.kv_block_size, served.max_model_len,
        settings.async_scheduling, engine.pid,
    )
    return served, engine


def build_engine(settings: GatewaySettings, tiers: TierTable, spec: ModelSpec,
                 model_dir: Path, gguf_file: Path | None = None) -> LLMEngine:
    """The engine over the checkpoint in model_dir (what the engine's process runs); gguf_file:
    the weights are read from that file, as stored where the kernels take them."""
    model_config = ModelConfig.from_file(model_dir)
    tokenizer = Tokenizer.from_dir(model_dir)
    config = engine_config(settings, tiers, model_config, tokenizer, spec)
    device = torch.device(spec.device or settings.device)
    if gguf_file is not None:
        model = load_gguf_model(GGUFCheckpoint.open(gguf_file), model_config, device,
                                config.scheduler.max_model_len)
        runner = TorchModelRunner(model, config)
    else:
        runner = TorchModelRunner.from_model_dir(
            model_dir, config, dtype=_DTYPES[spec.dtype or settings.dtype] or torch.float32,
            device=device)
    logger.info("weights: %s", runner.weight_format)
    size = runner.kv_cache_size
    if size is not None:
        block_size = config.cache.block_size
        logger.info(
            "KV cache %.2f GiB, %s: %d blocks of %d tokens, %d tokens",
            size.num_bytes / (1 << 30), size.source, runner.num_kv_blocks, block_size,
            runner.num_kv_blocks * block_size,
        )
    engine = new_engine(settings, config, runner, model_config, tokenizer,
                        background_priority=tiers.background_priority())
    if engine.grammars is not None:
        engine.grammars.warm_up()  # while the server starts, not on the first request
    return engine


def engine_config(
    settings: GatewaySettings, tiers: TierTable, model_config: ModelConfig, tokenizer: Tokenizer,
    spec: ModelSpec,
) -> EngineConfig:
    """A model's engine configuration, read by its scheduler and its runner: the replica's
    settings, with the model's own KV budget and context where its spec sets them."""
    eos_ids = eos_token_ids(model_config, tokenizer)
    own_budget = spec.kv_cache_bytes is not None or spec.kv_cache_memory_fraction is not None
    runner = RunnerConfig(
        kv_cache_bytes=spec.kv_cache_bytes if own_budget else settings.kv_cache_bytes,
        kv_cache_memory_fraction=(spec.kv_cache_memory_fraction if own_budget
                                  else settings.kv_cache_memory_fraction),
        kv_cache_memory_scale=spec.kv_memory_scale,
        kv_cache_dtype=settings.kv_cache_dtype,
    )
    if settings.cpu_decode_rows is not None:
        runner.cpu_decode_rows = settings.cpu_decode_rows
    return EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=settings.max_num_batched_tokens,
            max_num_seqs=settings.max_num_seqs,
            max_model_len=context_length(settings, model_config, spec),
        ),
        cache=CacheConfig(
            reserved_fractions=tiers.reserved_fractions() if settings.scheduling == "tiered"
            else {},
        ),
        eos_token_id=eos_ids[0] if eos_ids else None,
        async_scheduling={"auto": None, "on": True, "off": False}[settings.async_scheduling],
        grammar_budget=GrammarBudget(
            max_step_s=settings.grammar_max_step_ms / 1000,
            max_mean_s_per_token=settings.grammar_max_ms_per_token / 1000,
        ),
        runner=runner,
        lora=LoraConfig(max_loras=settings.max_loras, max_cpu_loras=settings.max_cpu_loras,
                        max_lora_rank=settings.max_lora_rank),
    )


def new_engine(
    settings: GatewaySettings,
    config: EngineConfig,
    runner: ModelRunner,
    model_config: ModelConfig,
    tokenizer: Tokenizer,
    background_priority: int | None = None,
) -> LLMEngine:
    """The engine over runner (built from config) with the replica's scheduling policy;
    background_priority: where the tiered policy's background tiers begin (None: none)."""
    policy: SchedulingPolicy = (
        TieredPolicy(config=TieredPolicyConfig(background_priority=background_priority))
        if settings.scheduling == "tiered" else FCFSPolicy()
    )
    grammars = GrammarCompiler(tokenizer, model_config.vocab_size,
                               list(eos_token_ids(model_config, tokenizer)))
    return LLMEngine(config, runner, policy, tokenizer, grammars=grammars)


def describe_model(
    model_config: ModelConfig,
    tokenizer: ChatTokenizer,
    name: str,
    created: int,
    engine: EngineClient,
    vocab_size: int | None = None,
    tool_call_parser: str = "auto",
) -> ServedModel:
    """What the HTTP layer is told of the model, and of the engine built for it (its limits,
    its weight format). vocab_size: the ids clients may send (default: the model's
    vocabulary)."""
    _ = tokenizer.max_token_bytes  # read the vocabulary now, not on the first large prompt
    limits = engine.limits
    return ServedModel(
        name=name,
        tokenizer=tokenizer,
        eos_token_ids=eos_token_ids(model_config, tokenizer),
        vocab_size=vocab_size or model_config.vocab_size,
        max_model_len=limits.max_model_len,
        created=created,
        num_kv_blocks=limits.num_kv_blocks,
        kv_block_size=limits.block_size,
        tool_format=format_for_template(tokenizer.chat_template, tool_call_parser),
        grammars=GrammarCompiler(tokenizer, vocab_size or model_config.vocab_size,
                                 list(eos_token_ids(model_config, tokenizer))),
        model_config=model_config,
        weight_format=engine.weight_format,
    )


def eos_token_ids(model_config: ModelConfig, tokenizer: Tokenizer) -> tuple[int, ...]:
    """The config's eos ids, and the tokenizer's after them if it is not among them."""
    eos_ids = list(model_config.eos_token_ids)
    if tokenizer.eos_token_id is not None and tokenizer.eos_token_id not in eos_ids:
        eos_ids.append(tokenizer.eos_token_id)
    return tuple(eos_ids)


def tenant_context(
    served: ServedModel,
    tiers: TierTable,
    *,
    tenant_id: int,
    tier: str,
    weight: float,
    cache_salt: str,
    kv_cap_share: float | None,
    scheduling: str,
) -> TenantContext:
    """What the engine is told about a request's tenant. Under FCFS every tenant is one
    class: same priority, no reservations (the vLLM-style baseline)."""
    priority = tiers[tier].priority if scheduling == "tiered" else 1
    kv_cap = None if kv_cap_share is None else max(1, int(kv_cap_share * served.num_kv_blocks))
    return TenantContext(
        tenant_id=str(tenant_id),
        tier=tier,
        priority=priority,
        weight=weight,
        cache_salt=cache_salt,
        kv_cap_blocks=kv_cap,
    )
