"""NoWorkRunner: the host side of a step without the model, to measure the engine's own work.

It keeps the requests and builds each step's forward inputs exactly as TorchModelRunner does
(engine.input_batch, on the CPU), then skips the forward and "samples" one constant token for
every request that samples. What a step costs with it is the engine's host work: scheduling,
input building, output processing. A benchmark tool (`tiergate bench engine`), never a default.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.flops import FlopsCounter
from engine.input_batch import InputBatch
from engine.models.config import ModelConfig
from engine.queued_step import QueuedStep
from engine.runner import FinishedStep, ModelRunnerOutput, RunnerStep
from engine.sampler import SampledTokens
from engine.scheduler_output import SchedulerOutput

__all__ = ["LLAMA_1B", "NoWorkRunner"]

# The 1B Llama shape of the engine's GPU measurements (HF config fields).
LLAMA_1B = {
    "architectures": ["LlamaForCausalLM"],
    "model_type": "llama",
    "vocab_size": 128256,
    "hidden_size": 2048,
    "intermediate_size": 8192,
    "num_hidden_layers": 16,
    "num_attention_heads": 32,
    "num_key_value_heads": 8,
    "head_dim": 64,
    "max_position_embeddings": 8192,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "tie_word_embeddings": True,
}


class NoWorkRunner:
    """The ModelRunner protocol with the forward left out (a measuring tool)."""

    def __init__(
        self,
        num_kv_blocks: int,
        block_size: int = 16,
        max_num_seqs: int = 256,
        max_model_len: int = 4096,
        model_config: ModelConfig | None = None,
        token_id: int = 7,
    ) -> None:
        """model_config: the model whose FLOPs metering splits a step by (as the real runner
        would); None: a 1B Llama shape (hidden 2048, 16 layers)."""
        self.num_kv_blocks = num_kv_blocks
        self.block_size = block_size
        self.token_id = token_id  # what every sampling request gets
        self.input_batch = InputBatch(block_size, max_num_seqs, max_model_len)
        self.num_tokens_built = 0  # tokens whose inputs were built (proof the work happened)
        self._flops = FlopsCounter(model_config or ModelConfig.from_dict(LLAMA_1B))
        self._device = torch.device("cpu")

    def estimate_flops(
        self, num_new: np.ndarray, num_context: np.ndarray, num_sampled: np.ndarray
    ) -> np.ndarray:
        return self._flops.many(num_new, num_context, num_sampled)

    @property
    def runs_ahead(self) -> bool:
        """Its steps are done when execute returns."""
        return False

    def synchronize(self) -> None:
        """Nothing runs asynchronously."""

    def execute(self, scheduler_output: SchedulerOutput) -> RunnerStep:
        batch = self.input_batch
        batch.update(scheduler_output)
        chunks = scheduler_output.chunks
        if not chunks:
            return FinishedStep(ModelRunnerOutput(sampled_token_ids={}))
        inputs = batch.prepare(chunks)
        forward_batch = inputs.to_device(self._device, batch.sampled_on_device)
        self.num_tokens_built += int(forward_batch.input_ids.shape[0])
        states = batch.sample_states(chunks)
        sampled = [self.token_id] * len(states)
        on_device = torch.full((len(states),), self.token_id, dtype=torch.int64)
        tokens = SampledTokens([s.request_id for s in states], on_device, sampled)
        pending = batch.mark_sampled(states, tokens.token_ids, inputs.sample_rows)
        return QueuedStep(batch, pending, tokens)
