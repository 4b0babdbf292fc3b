"""tiergate's engine: paged KV cache, tier-aware continuous batching, model execution.

Usable on its own: no database, no HTTP, nothing else of the project.
"""

from engine.config import CacheConfig, ConfigError, EngineConfig, SchedulerConfig
from engine.errors import (
    ContextLengthExceededError,
    EngineDeadError,
    EngineError,
    InvalidRequestError,
)
from engine.fcfs_policy import FCFSPolicy
from engine.llm_engine import LLMEngine, TenantContext
from engine.outputs import RequestMetrics, RequestOutput
from engine.queues import FCFSQueue, WaitingQueue
from engine.request import Request, RequestStatus
from engine.runner import ModelRunner, ModelRunnerOutput, TokenLogprobs
from engine.sampling_params import MAX_STOP_STRING_CHARS, SamplingParams
from engine.scheduler_output import ScheduledChunk, SchedulerOutput
from engine.scheduler_stats import (
    EngineCounters,
    SchedulerStats,
    TenantShare,
    TierStats,
    Unseen,
)
from engine.scheduling_policy import (
    AdmissionGate,
    SchedulingPolicy,
    StepBuilder,
    Verdict,
)

__all__ = [
    "MAX_STOP_STRING_CHARS",
    "AdmissionGate",
    "CacheConfig",
    "ConfigError",
    "ContextLengthExceededError",
    "EngineConfig",
    "EngineCounters",
    "EngineDeadError",
    "EngineError",
    "FCFSPolicy",
    "FCFSQueue",
    "InvalidRequestError",
    "LLMEngine",
    "ModelRunner",
    "ModelRunnerOutput",
    "Request",
    "RequestMetrics",
    "RequestOutput",
    "RequestStatus",
    "SamplingParams",
    "ScheduledChunk",
    "SchedulerConfig",
    "SchedulerOutput",
    "SchedulerStats",
    "SchedulingPolicy",
    "StepBuilder",
    "TenantContext",
    "TenantShare",
    "TierStats",
    "TokenLogprobs",
    "Unseen",
    "Verdict",
    "WaitingQueue",
]
