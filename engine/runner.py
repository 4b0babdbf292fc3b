"""The seam between the engine step and whatever executes the model."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from engine.errors import RequestFault
from engine.scheduler_output import SchedulerOutput


@dataclass
class TokenLogprobs:
    """Log-probabilities around one sampled token."""

    token_id: int  # the sampled token
    logprob: float  # its log-probability under the (penalised, unscaled-by-temperature) logits
    rank: int  # 1-based rank of the sampled token
    top: list[tuple[int, float]] = field(default_factory=list)  # top-k (token id, logprob)


@dataclass
class ModelRunnerOutput:
    """Result of one step: one new token per chunk that asked to be sampled."""

    sampled_token_ids: dict[str, int]  # request_id -> the token sampled this step
    logprobs: dict[str, TokenLogprobs] = field(default_factory=dict)  # when requested
    # Requests whose grammar matcher failed this step (past its limits, or the library
    # raised): they end with an error rather than go on unconstrained.
    grammar_faults: dict[str, RequestFault] = field(default_factory=dict)
    # Host time each constrained request's matcher took this step (mask and advance): the
    # request's to pay and bounded per request (engine.grammar_budget).
    grammar_seconds: dict[str, float] = field(default_factory=dict)
    # The step's time on the device where the runner measured it (CUDA events); None: the
    # engine times the step on its clock.
    device_time_s: float | None = None


class RunnerStep(Protocol):
    """A step the runner has queued; its output may still be on the way."""

    def result(self) -> ModelRunnerOutput:
        """Wait for the step's sampled tokens (and logprobs) on the host. Called once."""
        ...


@dataclass
class FinishedStep:
    """A step whose output was ready when execute returned."""

    output: ModelRunnerOutput

    def result(self) -> ModelRunnerOutput:
        return self.output


class ModelRunner(Protocol):
    """Executes a scheduled step over the paged KV cache.

    Implementations: engine.model_runner.TorchModelRunner (real models),
    engine.testing.fake_runner.FakeModelRunner (a test and simulation tool, never a default).
    """

    @property
    def num_kv_blocks(self) -> int:
        """KV blocks the runner allocated; the block pool manages exactly this many."""
        ...

    @property
    def block_size(self) -> int:
        """Tokens per KV block."""
        ...

    @property
    def runs_ahead(self) -> bool:
        """execute returns before the device has finished the step (CUDA): the host can
        schedule the next step meanwhile (async scheduling pays)."""
        ...

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerStep:
        """Copy blocks, write the new K/V, run the model, sample; the work may still be in
        flight when it returns. The next execute may come before this step's result(): a
        chunk may then compute a token this step sampled, which the runner still holds (async
        scheduling). Steps run in the order they are given."""
        ...

    def synchronize(self) -> None:
        """Wait until all work the runner queued on its device is done, so that the engine's
        clock read afterwards ends the step's busy time (a no-op on CPU)."""
        ...

    def estimate_flops(
        self, num_new: np.ndarray, num_context: np.ndarray, num_sampled: np.ndarray
    ) -> np.ndarray:
        """Model FLOPs of each chunk: num_new tokens that end at num_context tokens of
        context, with logits for num_sampled of them; int64 arrays in, float64 out (metering
        weighs a step's chunks by it, engine.metering.FlopsEstimator)."""
        ...
