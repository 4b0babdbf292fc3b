"""tiergate's engine: paged KV cache, tier-aware continuous batching, model execution.

Usable on its own: no database, no HTTP, nothing else of the project. These names are its
public surface; its modules are private to it. The names that need torch (model runner,
model configs, checkpoints) are imported on first use, so `import engine` stays light.
"""

import importlib
from typing import TYPE_CHECKING

from engine.compiled_core import core_name
from engine.config import (
    CPU_DECODE_MAX_ROWS,
    CacheConfig,
    ConfigError,
    EngineConfig,
    SchedulerConfig,
)
from engine.engine_client import EngineClient
from engine.engine_process import EngineProcess
from engine.errors import (
    ContextLengthExceededError,
    EngineDeadError,
    EngineError,
    InvalidRequestError,
    RequestErrorCode,
    RequestFault,
)
from engine.fcfs_policy import FCFSPolicy
from engine.grammar_budget import GrammarBudget
from engine.grammar_compiler import GrammarCompiler
from engine.kv_manager import tier_allowance
from engine.llm_engine import LLMEngine, TenantContext
from engine.outputs import RequestMetrics, RequestOutput
from engine.queues import FCFSQueue, WaitingQueue
from engine.rates import Arrivals
from engine.request import Request, RequestStatus
from engine.request_limits import RequestLimits
from engine.runner import ModelRunner, ModelRunnerOutput, TokenLogprobs
from engine.sampling_params import (
    MAX_STOP_CHARS_PER_REQUEST,
    MAX_STOP_STRING_CHARS,
    MAX_STOP_TOKEN_IDS,
    SamplingParams,
)
from engine.scheduler_output import ScheduledChunk, SchedulerOutput
from engine.scheduler_stats import (
    EngineCounters,
    SchedulerStats,
    TierStats,
)
from engine.scheduling_policy import (
    AdmissionGate,
    SchedulingPolicy,
    StepBuilder,
    Verdict,
)
from engine.structured_output import JSON_OPTIONS, StructuredOutput, bounded_numbers
from engine.tokenizer import Tokenizer

if TYPE_CHECKING:
    from engine.demo_model import write_demo_model
    from engine.gguf_checkpoint import GGUFCheckpoint
    from engine.model_runner import RunnerConfig, TorchModelRunner
    from engine.models.config import ModelConfig, ModelConfigError

__all__ = [
    "CPU_DECODE_MAX_ROWS",
    "JSON_OPTIONS",
    "MAX_STOP_CHARS_PER_REQUEST",
    "MAX_STOP_STRING_CHARS",
    "MAX_STOP_TOKEN_IDS",
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
    "InvalidRequestError",
    "LLMEngine",
    "ModelConfig",
    "ModelConfigError",
    "ModelRunner",
    "ModelRunnerOutput",
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
    "StructuredOutput",
    "TenantContext",
    "TierStats",
    "TokenLogprobs",
    "Tokenizer",
    "TorchModelRunner",
    "Verdict",
    "WaitingQueue",
    "bounded_numbers",
    "core_name",
    "tier_allowance",
    "write_demo_model",
]

# Public names whose modules import torch: each is imported by its first lookup.
_LAZY_MODULES: dict[str, str] = {
    "GGUFCheckpoint": "engine.gguf_checkpoint",
    "ModelConfig": "engine.models.config",
    "ModelConfigError": "engine.models.config",
    "RunnerConfig": "engine.model_runner",
    "TorchModelRunner": "engine.model_runner",
    "write_demo_model": "engine.demo_model",
}


def __getattr__(name: str) -> object:
    module_name = _LAZY_MODULES.get(name)
    if module_name is None:
        raise AttributeError(f"module 'engine' has no attribute {name!r}")
    value = getattr(importlib.import_module(module_name), name)
    globals()[name] = value  # later lookups skip this function
    return value
