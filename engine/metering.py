"""Step metering: split one step's measured busy time over its requests by their FLOPs.

Each chunk of a step costs what the runner estimates for its tokens: the linear layers per
token plus attention over each token's context (engine.flops). Tokens of a chunk below the
request's high-water mark were computed once already and lost to a preemption: their share is
recompute, reported apart so that the tenant whose request caused the preemption pays for it.
The parts add up to the step time: the remainder of the rounding goes to the largest part.
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from engine.scheduler_output import ScheduledChunk

__all__ = ["ChunkCharge", "FlopsEstimator", "num_recompute_tokens", "split_step_time"]


class FlopsEstimator(Protocol):
    """FLOPs of num_new_tokens ending at num_context_tokens of context (cached prefix plus the
    new tokens), with lm_head logits for num_sampled_tokens of them (ModelRunner.estimate_flops)."""

    def __call__(
        self, num_new_tokens: int, num_context_tokens: int, num_sampled_tokens: int, /
    ) -> float: ...


@dataclass(slots=True)
class ChunkCharge:
    """One chunk's share of a step's busy time."""

    request_id: str
    gpu_seconds: float  # own compute: tokens the request computes for the first time
    recompute_gpu_seconds: float  # tokens computed again after a preemption
    num_recomputed_tokens: int  # tokens of the chunk below the request's high-water mark


def num_recompute_tokens(chunk: ScheduledChunk, num_computed_high_water: int) -> int:
    """Tokens of the chunk at positions the request had computed before a preemption."""
    return max(0, min(chunk.num_tokens, num_computed_high_water - chunk.start_pos))


def split_step_time(
    chunks: Sequence[ScheduledChunk],
    high_water: Mapping[str, int],
    step_time_s: float,
    estimate_flops: FlopsEstimator,
) -> list[ChunkCharge]:
    """One charge per chunk (same order); the charges' seconds sum to step_time_s.

    high_water: request id -> num_computed_high_water (absent: never preempted).
    """
    if not chunks:
        return []
    num_recompute = (
        [num_recompute_tokens(c, high_water.get(c.request_id, 0)) for c in chunks]
        if high_water
        else [0] * len(chunks)
    )
    # A weight per chunk for its own tokens, then, when any chunk recomputes, one per chunk
    # for its recompute tokens. Those come first in the chunk; the own tokens attend over
    # them too, and only the own part samples.
    weights = [
        estimate_flops(c.num_tokens - old, c.start_pos + c.num_tokens, int(c.needs_sample))
        for c, old in zip(chunks, num_recompute, strict=True)
    ]
    recomputes = any(num_recompute)
    if recomputes:
        weights += [
            estimate_flops(old, c.start_pos + old, 0) if old else 0.0
            for c, old in zip(chunks, num_recompute, strict=True)
        ]
    total = math.fsum(weights)
    if not (total > 0 and math.isfinite(total)):  # a cost model that prices nothing
        weights = [float(c.num_tokens - old) for c, old in zip(chunks, num_recompute, strict=True)]
        if recomputes:
            weights += [float(old) for old in num_recompute]
        total = math.fsum(weights)
    parts = _proportional_parts(weights, total, step_time_s)
    num_chunks = len(chunks)
    return [
        ChunkCharge(c.request_id, parts[i], parts[num_chunks + i] if recomputes else 0.0,
                    num_recompute[i])
        for i, c in enumerate(chunks)
    ]


def _proportional_parts(weights: list[float], total: float, amount: float) -> list[float]:
    """amount * weight / total each, rounded to whole ulps of amount; the largest part takes
    the remainder. Every partial sum is then a multiple of that ulp no larger than amount, so
    it is exact: the parts add up to exactly amount in floating point, in any order."""
    quantum = math.ulp(amount)
    parts = [round(amount * (w / total) / quantum) * quantum for w in weights]
    largest = weights.index(max(weights))  # the first of the largest
    parts[largest] = 0.0
    parts[largest] = amount - sum(parts)
    return parts
