"""Scheduling: requests, the waiting queues and policies, the scheduler and its step plan,
stop checks on tokens, metering, and `LLMEngine`, which runs one step (schedule, run, update).

May import the KV cache (`core.kv_cache`), structured output, text and the neutral modules;
never the worker, the process or the models: the runner is reached through `ModelRunner`
(engine.types).
"""

from engine.core.fcfs_policy import FCFSPolicy
from engine.core.llm_engine import LLMEngine
from engine.core.metering import split_step_time
from engine.core.queues import FCFSQueue, WaitingQueue
from engine.core.rates import ArrivalRates, Arrivals, StepRates
from engine.core.request import Request, RequestStatus
from engine.core.request_limits import RequestLimits
from engine.core.scheduler import Scheduler
from engine.core.scheduler_stats import EngineCounters, SchedulerStats, TierStats
from engine.core.scheduling_policy import AdmissionGate, SchedulingPolicy, StepBuilder, Verdict

__all__ = [
    "AdmissionGate",
    "ArrivalRates",
    "Arrivals",
    "EngineCounters",
    "FCFSPolicy",
    "FCFSQueue",
    "LLMEngine",
    "Request",
    "RequestLimits",
    "RequestStatus",
    "Scheduler",
    "SchedulerStats",
    "SchedulingPolicy",
    "StepBuilder",
    "StepRates",
    "TierStats",
    "Verdict",
    "WaitingQueue",
    "split_step_time",
]
