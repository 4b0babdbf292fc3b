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

import numpy as np

from engine.scheduler_output import ScheduledChunk

__all__ = ["FlopsEstimator", "StepSplit", "num_recompute_tokens", "split_step_time"]


class FlopsEstimator(Protocol):
    """FLOPs of each chunk: num_new tokens ending at num_context tokens of context (cached
    prefix plus the new tokens), with lm_head logits for num_sampled of them; int64 arrays in,
    float64 out (ModelRunner.estimate_flops)."""

    def __call__(
        self, num_new: np.ndarray, num_context: np.ndarray, num_sampled: np.ndarray, /
    ) -> np.ndarray: ...


@dataclass(slots=True)
class StepSplit:
    """One step's busy time over its chunks (same order)."""

    gpu_seconds: list[float]  # own compute: tokens each request computes for the first time
    recompute_gpu_seconds: list[float]  # tokens computed again after a preemption
    num_recomputed_tokens: list[int]  # tokens of each chunk below its request's high-water mark


def num_recompute_tokens(chunk: ScheduledChunk, num_computed_high_water: int) -> int:
    """Tokens of the chunk at positions the request had computed before a preemption."""
    return max(0, min(chunk.num_tokens, num_computed_high_water - chunk.start_pos))


def split_step_time(
    chunks: Sequence[ScheduledChunk],
    high_water: Mapping[str, int],
    step_time_s: float,
    estimate_flops: FlopsEstimator,
    adapter_flops_per_token: np.ndarray | None = None,
) -> StepSplit:
    """The step's time over its chunks; the parts (own and recompute) sum to step_time_s.

    high_water: request id -> num_computed_high_water (absent: never preempted).
    adapter_flops_per_token: per chunk, what its LoRA adapter adds to each of its tokens
    (None: no chunk runs on one). Vectorized over the chunks: metering runs after every
    step, for every chunk.
    """
    count = len(chunks)
    if not count:
        return StepSplit([], [], [])
    if count == 1 and high_water.get(chunks[0].request_id, 0) <= chunks[0].start_pos:
        # One chunk recomputing nothing takes the whole step (what the split below gives,
        # without its arrays' fixed cost: a batch-1 step's metering).
        return StepSplit([step_time_s], [0.0], [0])
    starts = np.fromiter((c.start_pos for c in chunks), np.int64, count)
    lengths = np.fromiter((c.num_tokens for c in chunks), np.int64, count)
    sampled = np.fromiter((c.needs_sample for c in chunks), np.int64, count)
    if high_water:
        old = np.fromiter(
            (num_recompute_tokens(c, high_water.get(c.request_id, 0)) for c in chunks),
            np.int64, count,
        )
    else:
        old = np.zeros(count, dtype=np.int64)
    recomputes = bool(old.any())
    # A weight per chunk for its own tokens, then, when any chunk recomputes, one per chunk
    # for its recompute tokens. Those come first in the chunk; the own tokens attend over
    # them too, and only the own part samples.
    weights = estimate_flops(lengths - old, starts + lengths, sampled)
    if adapter_flops_per_token is not None:
        weights = weights + adapter_flops_per_token * (lengths - old)
    if recomputes:
        recompute_weights = np.where(old > 0, estimate_flops(old, starts + old, old * 0), 0.0)
        if adapter_flops_per_token is not None:
            recompute_weights = recompute_weights + adapter_flops_per_token * old
        weights = np.concatenate([weights, recompute_weights])
    total = math.fsum(weights.tolist())
    if not (total > 0 and math.isfinite(total)):  # a cost model that prices nothing
        weights = (lengths - old).astype(np.float64)
        if recomputes:
            weights = np.concatenate([weights, old.astype(np.float64)])
        total = math.fsum(weights.tolist())
    parts = _proportional_parts(weights, total, step_time_s)
    return StepSplit(
        parts[:count],
        parts[count:] if recomputes else [0.0] * count,
        old.tolist(),
    )


def _proportional_parts(weights: np.ndarray, total: float, amount: float) -> list[float]:
    """amount * weight / total each, rounded to whole ulps of amount; the largest part takes
    the remainder. Every partial sum is then a multiple of that ulp no larger than amount, so
    it is exact: the parts add up to exactly amount in floating point, in any order."""
    quantum = math.ulp(amount)
    parts = np.round(amount * (weights / total) / quantum) * quantum
    largest = int(np.argmax(weights))  # the first of the largest
    parts[largest] = 0.0
    parts[largest] = amount - math.fsum(parts.tolist())
    result: list[float] = parts.tolist()
    return result
