"""tiergate's engine: paged KV cache, tier-aware continuous batching, model execution.

Usable on its own: no database, no HTTP, nothing else of the project. These names are its
public surface; its modules are private to it. The names that need torch (model runner,
model configs, checkpoints) are imported on first use, so `import engine` stays light.
"""

import importlib
from typing import TYPE_CHECKING

from engine.config import (
    CPU_DECODE_MAX_ROWS,
    KV_CACHE_DTYPES,
    CacheConfig,
    ConfigError,
    EngineConfig,
    LoraConfig,
    RunnerConfig,
    SchedulerConfig,
)
from engine.core.fcfs_policy import FCFSPolicy
from engine.core.kv_cache.kv_manager import tier_allowance
from engine.core.llm_engine import LLMEngine
from engine.core.queues import FCFSQueue, WaitingQueue
from engine.core.rates import Arrivals
from engine.core.request import Request, RequestStatus
from engine.core.request_limits import RequestLimits
from engine.core.scheduler_stats import (
    EngineCounters,
    SchedulerStats,
    TierStats,
)
from engine.core.scheduling_policy import (
    AdmissionGate,
    SchedulingPolicy,
    StepBuilder,
    Verdict,
)
from engine.errors import (
    ContextLengthExceededError,
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    RequestErrorCode,
    RequestFault,
)
from engine.grammar_budget import GrammarBudget
from engine.output_spec import JSON_OPTIONS, StructuredOutput, bounded_numbers, subschemas
from engine.process.engine_client import EngineClient, OutputStream
from engine.process.engine_process import EngineProcess
from engine.sampling_params import (
    MAX_STOP_CHARS_PER_REQUEST,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from engine.scheduler_output import ScheduledChunk, SchedulerOutput
from engine.step_outputs import OutputEnd, StepOutputs
from engine.structured_output.grammar_compiler import GrammarCompiler
from engine.text.detokenizer import IncrementalDetokenizer
from engine.text.tokenizer import Tokenizer
from engine.types import (
    LoraRequest,
    ModelRunner,
    ModelRunnerOutput,
    RequestMetrics,
    RequestOutput,
    TenantContext,
    TokenLogprobs,
)

if TYPE_CHECKING:
    from engine.checkpoints.demo_model import write_demo_model
    from engine.checkpoints.gguf_checkpoint import GGUFCheckpoint
    from engine.checkpoints.gguf_panels import load_gguf_model
    from engine.checkpoints.lora_adapter import AdapterError, read_lora_adapter
    from engine.models.config import ModelConfig, ModelConfigError
    from engine.worker.model_runner import TorchModelRunner

__all__ = [
    "CPU_DECODE_MAX_ROWS",
    "JSON_OPTIONS",
    "KV_CACHE_DTYPES",
    "MAX_STOP_CHARS_PER_REQUEST",
    "MAX_STOP_STRING_CHARS",
    "MAX_STOP_TOKEN_IDS",
    "AdapterError",
    "AdmissionGate",
    "Arrivals",
    "CacheConfig",
    "ConfigError",
    "ContextLengthExceededError",
    "EngineClient",
    "EngineConfig",
    "EngineCounters",
    "EngineDeadError",
    "EngineError",
    "EngineProcess",
    "FCFSPolicy",
    "FCFSQueue",
    "GGUFCheckpoint",
    "GrammarBudget",
    "GrammarCompiler",
    "IncrementalDetokenizer",
    "InvalidRequestError",
    "LLMEngine",
    "LoraConfig",
    "LoraRequest",
    "ModelConfig",
    "ModelConfigError",
    "ModelRunner",
    "ModelRunnerOutput",
    "OutputEnd",
    "OutputStream",
    "Request",
    "RequestErrorCode",
    "RequestFault",
    "RequestLimits",
    "RequestMetrics",
    "RequestOutput",
    "RequestStatus",
    "RunnerConfig",
    "SamplingParams",
    "ScheduledChunk",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "SchedulingPolicy",
    "StepBuilder",
    "StepOutputs",
    "StructuredOutput",
    "TenantContext",
    "TierStats",
    "TokenLogprobs",
    "Tokenizer",
    "TorchModelRunner",
    "Verdict",
    "WaitingQueue",
    "bounded_numbers",
    "load_gguf_model",
    "read_lora_adapter",
    "subschemas",
    "tier_allowance",
    "write_demo_model",
]

# Public names whose modules import torch: each is imported by its first lookup.
_LAZY_MODULES: dict[str, str] = {
    "AdapterError": "engine.checkpoints.lora_adapter",
    "GGUFCheckpoint": "engine.checkpoints.gguf_checkpoint",
    "ModelConfig": "engine.models.config",
    "ModelConfigError": "engine.models.config",
    "TorchModelRunner": "engine.worker.model_runner",
    "load_gguf_model": "engine.checkpoints.gguf_panels",
    "read_lora_adapter": "engine.checkpoints.lora_adapter",
    "write_demo_model": "engine.checkpoints.demo_model",
}


def __getattr__(name: str) -> object:
    module_name = _LAZY_MODULES.get(name)
    if module_name is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later lookups skip this function
    return value
