"""QueuedStep: a runner's step whose sampled tokens are on their way back to its batch."""

from __future__ import annotations

import torch

from engine.sample.sampler import SampledTokens
from engine.types import ModelRunnerOutput
from engine.worker.input_batch import InputBatch, PendingTokens

__all__ = ["QueuedStep", "StepEvents"]

# A step's start and end on a CUDA stream.
StepEvents = tuple[torch.cuda.Event, torch.cuda.Event]


class QueuedStep:
    """The RunnerStep of runners that keep an InputBatch: result() brings the sampled ids to
    the host and into the batch (which took them as pending when the step was queued)."""

    def __init__(
        self,
        input_batch: InputBatch,
        pending: PendingTokens,
        sampled: SampledTokens,
        events: StepEvents | None = None,
    ) -> None:
        """pending: what input_batch noted of the step's tokens; sampled: in host memory
        (from CUDA, copied there without waiting); events: the step's start and end on the
        CUDA stream (None where execute did all the work)."""
        self._input_batch = input_batch
        self._pending = pending
        self._sampled = sampled
        self._events = events

    def result(self) -> ModelRunnerOutput:
        device_time_s = None
        if self._events is not None:
            start, end = self._events
            end.synchronize()
            device_time_s = start.elapsed_time(end) / 1000.0
        output = self._sampled.output()
        output.device_time_s = device_time_s
        self._input_batch.append_sampled(self._pending, output.token_ids)
        return output
