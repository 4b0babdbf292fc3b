"""FakeModelRunner: a deterministic stand-in for the model, for tests and simulation only.

It keeps a fake KV cache that stores each token id in its slot, and "samples" the next token
as a hash of the whole context read back through the block table. A paging bug (a wrong block
table, a missed copy-on-write, a block reused while still held) changes the context it reads
and so the tokens it produces. Its step time follows a cost model, so schedulers can be
compared on a simulated machine. Never a default: the engine's real runner is TorchModelRunner.
"""

from __future__ import annotations

import concurrent.futures
import hashlib
import time
from array import array
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import TypeVar

import numpy as np
import torch

from engine.config import EngineConfig
from engine.sample.sampler import SampledTokens
from engine.scheduler_output import ScheduledChunk, SchedulerOutput
from engine.types import LoraRequest, RunnerStep
from engine.worker.batch_runner import BatchRunner, given_num_kv_blocks
from engine.worker.input_batch import RequestState, StepInputs

__all__ = ["CostModel", "FakeModelRunner", "fake_next_token"]


@dataclass
class CostModel:
    """Step time of the simulated machine: fixed + per batched token + per attended token."""

    step_overhead_s: float = 0.004
    per_token_s: float = 0.00005  # linear layers, per token in the batch
    per_context_token_s: float = 2e-8  # attention, per (token, context token) pair
    flops_per_token: float = 1e8  # 2 x parameters, for metering
    flops_per_context_token: float = 1e4  # attention FLOPs per attended token

    def step_time_s(self, num_tokens: int, num_attended: int) -> float:
        return (
            self.step_overhead_s
            + self.per_token_s * num_tokens
            + self.per_context_token_s * num_attended
        )


def fake_next_token(context: list[int], vocab_size: int) -> int:
    """token = f(context): ids 3..vocab_size-1 (0-2 are special)."""
    digest = hashlib.blake2b(array("q", context).tobytes(), digest_size=8).digest()
    return 3 + int.from_bytes(digest, "little") % (vocab_size - 3)


class FakeModelRunner(BatchRunner):
    """Test and simulation tool implementing the ModelRunner protocol."""

    def __init__(
        self,
        config: EngineConfig,
        vocab_size: int = 32000,
        cost_model: CostModel | None = None,
        advance_clock: Callable[[float], None] | None = None,
        sleep: bool = False,
    ) -> None:
        """config: the engine's; its runner.num_kv_blocks (required) sizes the fake cache."""
        num_kv_blocks = given_num_kv_blocks(config, "FakeModelRunner")
        # The requests it runs are kept as the real runner keeps them (BatchRunner): a wrong
        # incremental update reads the wrong context and changes the tokens.
        super().__init__(config, num_kv_blocks, torch.device("cpu"))
        self.vocab_size = vocab_size
        self.cost_model = cost_model or CostModel()
        # Simulation: advance a virtual clock by the modelled step time instead of sleeping.
        self.advance_clock = advance_clock
        self.sleep = sleep  # real time: sleep for the modelled step time
        self.extra_delay_s = 0.0  # test-only slow-down added to every step
        # Test-only: raise in the next execute (this exception, or a RuntimeError for True).
        self.fail_next_step: bool | BaseException = False
        self.num_steps = 0
        # Adapters: the most distinct ones a step ran (the scheduler's slot rule, checked).
        self.most_adapters_in_a_step = 0
        self.lora_holds: dict[str, int] = {}  # adapter name -> prepare_lora holds not released
        # kv[block][offset] = token id written there, or -1
        self._kv: list[list[int]] = [[-1] * self.block_size for _ in range(num_kv_blocks)]

    def estimate_flops(
        self, num_new: np.ndarray, num_context: np.ndarray, num_sampled: np.ndarray
    ) -> np.ndarray:
        """The cost model's FLOPs; it has no lm_head term, so sampled tokens cost nothing extra."""
        cost = self.cost_model
        flops = (cost.flops_per_token * num_new
                 + cost.flops_per_context_token * _num_attended(num_new, num_context))
        return np.asarray(flops, dtype=np.float64)

    def prepare_lora(self, lora: LoraRequest) -> concurrent.futures.Future[float]:
        """Any adapter is taken at once (no weights: the fake model's tokens ignore it, and
        it costs nothing), where the engine's config gives adapters slots; held adapters
        are counted (`lora_holds`)."""
        if self.config.lora.max_loras == 0:
            return super().prepare_lora(lora)
        self.lora_holds[lora.name] = self.lora_holds.get(lora.name, 0) + 1
        ready: concurrent.futures.Future[float] = concurrent.futures.Future()
        ready.set_result(0.0)
        return ready

    def release_lora(self, lora: LoraRequest) -> None:
        self.lora_holds[lora.name] -= 1
        if not self.lora_holds[lora.name]:
            del self.lora_holds[lora.name]

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerStep:
        """The modelled step time passes (or fails the step if told to), then the step."""
        chunks = scheduler_output.chunks
        num_attended = sum(_num_attended(c.num_tokens, c.num_context_tokens) for c in chunks)
        step_time = self.cost_model.step_time_s(scheduler_output.num_batched_tokens, num_attended)
        step_time += self.extra_delay_s
        if self.advance_clock is not None:
            self.advance_clock(step_time)
        elif self.sleep:
            time.sleep(step_time)
        if self.fail_next_step:  # after the step's time, like a real step failing in sampling
            failure, self.fail_next_step = self.fail_next_step, False
            if isinstance(failure, BaseException):
                raise failure
            raise RuntimeError("FakeModelRunner: injected step failure")
        self.num_steps += 1
        return super().execute(scheduler_output)

    # -- BatchRunner ---------------------------------------------------------------------------

    def _forward_and_sample(
        self, chunks: list[ScheduledChunk], inputs: StepInputs, states: list[RequestState]
    ) -> SampledTokens:
        """Write the step's tokens into the fake cache, then a hash of each sampling chunk's
        context as read back through its block table."""
        adapters = {lora.name for lora in self.input_batch.chunk_loras(chunks) if lora}
        self.most_adapters_in_a_step = max(self.most_adapters_in_a_step, len(adapters))
        # The KV writes come from the step's inputs as the real runner builds them, the ids of
        # tokens sampled by a step whose output is not back yet included.
        forward_batch = self._to_device(inputs)
        bs = self.block_size
        for token_id, slot in zip(forward_batch.input_ids.tolist(),
                                  forward_batch.slot_mapping.tolist(), strict=True):
            self._kv[slot // bs][slot % bs] = token_id
        context_lens = [c.num_context_tokens for c in chunks if c.needs_sample]
        sampled = [
            fake_next_token(self._read_context(self.input_batch.block_table(s.request_id), num),
                            self.vocab_size)
            for s, num in zip(states, context_lens, strict=True)
        ]
        return SampledTokens([s.request_id for s in states], torch.tensor(sampled), sampled)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        for src, dst in pairs:
            self._kv[dst] = list(self._kv[src])

    # -- helpers -------------------------------------------------------------------------------

    def _read_context(self, block_table: Sequence[int] | np.ndarray, num_tokens: int) -> list[int]:
        bs = self.block_size
        context: list[int] = []
        for index in range(-(-num_tokens // bs)):
            context.extend(self._kv[block_table[index]])
        del context[num_tokens:]
        assert -1 not in context, "read a KV slot that was never written"
        return context


_Count = TypeVar("_Count", int, np.ndarray)


def _num_attended(num_new_tokens: _Count, num_context_tokens: _Count) -> _Count:
    """(query, key) pairs of num_new_tokens ending at num_context_tokens, causal mask (per
    chunk, for arrays)."""
    return num_new_tokens * (2 * num_context_tokens - num_new_tokens + 1) // 2
