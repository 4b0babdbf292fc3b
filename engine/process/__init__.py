"""Where the engine loop runs and how callers reach it: `EngineLoop` (steps and commands),
`EngineProcess` (the loop in a process of its own, outputs in columns down a pipe),
`AsyncLLMEngine` (the loop in a thread) and `EngineClient` (what an asyncio caller holds).

May import every other room except testing.
"""

from engine.process.async_engine import AsyncLLMEngine
from engine.process.engine_client import EngineClient
from engine.process.engine_loop import AddRequest, EngineLoop, Stop
from engine.process.engine_process import EngineProcess
from engine.process.openmp_wait import (
    ENGINE_SPIN_COUNT,
    engine_openmp_environment,
    spawn_environment,
)

__all__ = [
    "ENGINE_SPIN_COUNT",
    "AddRequest",
    "AsyncLLMEngine",
    "EngineClient",
    "EngineLoop",
    "EngineProcess",
    "Stop",
    "engine_openmp_environment",
    "spawn_environment",
]
