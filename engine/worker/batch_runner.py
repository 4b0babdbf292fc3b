"""BatchRunner: the step of every runner that keeps its requests in an InputBatch.

One step: bring the batch up to date with the scheduler's output, copy KV blocks, build the
step's inputs, run the forward and sample (the subclass's part), note the sampled tokens in
the batch as pending and hand them back as a QueuedStep. The real runner (TorchModelRunner)
and the test and benchmark tools (engine.testing) differ only in that part.
"""

from __future__ import annotations

import concurrent.futures
from abc import ABC, abstractmethod

import numpy as np
import torch

from engine.config import EngineConfig
from engine.errors import ConfigError
from engine.models.batch import ForwardBatch
from engine.sample.sampler import SampledTokens
from engine.scheduler_output import ScheduledChunk, SchedulerOutput
from engine.types import FinishedStep, LoraRequest, ModelRunnerOutput, RunnerStep
from engine.worker.input_batch import InputBatch, RequestState, StepInputs
from engine.worker.queued_step import QueuedStep, StepEvents
from engine.worker.weight_format import NO_WEIGHTS_LABEL

__all__ = ["BatchRunner", "given_num_kv_blocks"]


class BatchRunner(ABC):
    """The ModelRunner (engine.types.ModelRunner) skeleton shared by every runner.

    A request's tokens and block table come to its InputBatch once, then only what changed,
    and the tokens it samples stay there. Subclasses fill in `_forward_and_sample`,
    `_copy_blocks` and `estimate_flops`; runners whose device runs ahead of the host override
    `runs_ahead`, `synchronize` and `_step_events`.
    """

    def __init__(self, config: EngineConfig, num_kv_blocks: int, device: torch.device) -> None:
        """config: the engine's, whose sizes (block size, sequences, context) size the batch;
        num_kv_blocks: the KV blocks the runner holds; device: where the forward runs."""
        self.config = config
        self.device = device
        self._num_kv_blocks = num_kv_blocks
        sizes = config.scheduler
        self.input_batch = InputBatch(config.cache.block_size, sizes.max_num_seqs,
                                      sizes.max_model_len)

    # -- ModelRunner ---------------------------------------------------------------------------

    @property
    def num_kv_blocks(self) -> int:
        return self._num_kv_blocks

    @property
    def block_size(self) -> int:
        return self.config.cache.block_size

    @property
    def runs_ahead(self) -> bool:
        """Its steps are done when execute returns (unless a subclass says otherwise)."""
        return False

    @property
    def weight_format_label(self) -> str:
        """engine.types.ModelRunner.weight_format_label: no weights (unless a subclass has
        some)."""
        return NO_WEIGHTS_LABEL

    def prepare_lora(self, lora: LoraRequest) -> concurrent.futures.Future[float]:
        """engine.types.ModelRunner.prepare_lora: no adapters unless a subclass serves them."""
        refused: concurrent.futures.Future[float] = concurrent.futures.Future()
        refused.set_exception(ValueError("this runner serves no LoRA adapters"))
        return refused

    def release_lora(self, lora: LoraRequest) -> None:  # noqa: B027 (nothing held here)
        """engine.types.ModelRunner.release_lora."""

    def synchronize(self) -> None:  # noqa: B027 (a no-op unless the device runs ahead)
        """Nothing runs asynchronously (unless a subclass says otherwise)."""

    @abstractmethod
    def estimate_flops(
        self, num_new: np.ndarray, num_context: np.ndarray, num_sampled: np.ndarray
    ) -> np.ndarray:
        """engine.types.ModelRunner.estimate_flops."""

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerStep:
        """Copy blocks, then one forward over every chunk, then sample the chunks that ask;
        where the device runs ahead all of it is queued, and the sampled tokens come back
        without a wait."""
        batch = self.input_batch
        batch.update(scheduler_output)
        chunks = scheduler_output.chunks
        if not chunks:
            if scheduler_output.blocks_to_copy:
                self._copy_blocks(scheduler_output.blocks_to_copy)
            return FinishedStep(ModelRunnerOutput([], []))
        events = self._step_events()
        if scheduler_output.blocks_to_copy:
            self._copy_blocks(scheduler_output.blocks_to_copy)
        inputs = batch.prepare(chunks)
        states = batch.sample_states(chunks)
        sampled = self._forward_and_sample(chunks, inputs, states)
        pending = batch.mark_sampled(states, sampled.token_ids, inputs.sample_rows)
        step = QueuedStep(batch, pending, sampled.to_host(), events)
        if events is not None:
            events[1].record()
        return step

    # -- hooks ---------------------------------------------------------------------------------

    @abstractmethod
    def _forward_and_sample(
        self, chunks: list[ScheduledChunk], inputs: StepInputs, states: list[RequestState]
    ) -> SampledTokens:
        """Run the step's forward over inputs (the chunks' tokens, built by the batch) and
        sample the next token of each of states (the chunks that sample, in chunk order);
        the tokens may still be on the device."""

    @abstractmethod
    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """Copy each (source, destination) KV block before the step's forward."""

    def _step_events(self) -> StepEvents | None:
        """The step's start and end events, the start recorded, for the device to time the
        step; None (the default): the engine times it on its clock."""
        return None

    # -- helpers -------------------------------------------------------------------------------

    def _to_device(self, inputs: StepInputs) -> ForwardBatch:
        """The step's inputs on the runner's device, tokens still pending filled in there."""
        return inputs.to_device(self.device, self.input_batch.sampled_on_device)


def given_num_kv_blocks(config: EngineConfig, runner_name: str) -> int:
    """config.runner.num_kv_blocks, which a runner with no memory to size its cache by (a
    test or benchmark tool) must be given."""
    num_kv_blocks = config.runner.num_kv_blocks
    if num_kv_blocks is None:
        raise ConfigError(f"{runner_name} needs runner.num_kv_blocks")
    return num_kv_blocks
