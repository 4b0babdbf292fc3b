"""Turns a request's `StructuredOutput` (engine.output_spec) into a grammar matcher, off the
step's critical path: the compiler, its fair worker thread and its per-tenant cache.

May import text and the neutral modules.
"""

from engine.structured_output.fair_worker import FairWorker
from engine.structured_output.grammar_compiler import (
    CompiledGrammar,
    GrammarCompiler,
    GrammarError,
    GrammarResult,
)
from engine.structured_output.partitioned_lru import PartitionedLru

__all__ = [
    "CompiledGrammar",
    "FairWorker",
    "GrammarCompiler",
    "GrammarError",
    "GrammarResult",
    "PartitionedLru",
]
