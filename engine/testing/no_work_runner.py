"""NoWorkRunner: the host side of a step without the model, to measure the engine's own work.

It keeps the requests and builds each step's forward inputs exactly as TorchModelRunner does
(engine.input_batch, on the CPU), then skips the forward and "samples" one constant token for
every request that samples. What a step costs with it is the engine's host work: scheduling,
input building, output processing. A benchmark tool (`tiergate bench engine`), never a default.
"""

from __future__ import annotations

import numpy as np
import torch

from engine.config import EngineConfig
from engine.models.config import ModelConfig
from engine.sample.sampler import SampledTokens
from engine.scheduler_output import ScheduledChunk
from engine.worker.batch_runner import BatchRunner, given_num_kv_blocks
from engine.worker.flops import FlopsCounter
from engine.worker.input_batch import RequestState, StepInputs

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


class NoWorkRunner(BatchRunner):
    """The ModelRunner protocol with the forward left out (a measuring tool)."""

    def __init__(
        self,
        config: EngineConfig,
        model_config: ModelConfig | None = None,
        token_id: int = 7,
    ) -> None:
        """config: the engine's, whose runner.num_kv_blocks (required) the runner reports;
        model_config: the model whose FLOPs metering splits a step by (as the real runner
        would); None: a 1B Llama shape (hidden 2048, 16 layers)."""
        super().__init__(config, given_num_kv_blocks(config, "NoWorkRunner"),
                         torch.device("cpu"))
        self.token_id = token_id  # what every sampling request gets
        self.num_tokens_built = 0  # tokens whose inputs were built (proof the work happened)
        self._flops = FlopsCounter(model_config or ModelConfig.from_dict(LLAMA_1B))

    def estimate_flops(
        self, num_new: np.ndarray, num_context: np.ndarray, num_sampled: np.ndarray
    ) -> np.ndarray:
        return self._flops.many(num_new, num_context, num_sampled)

    # -- BatchRunner ---------------------------------------------------------------------------

    def _forward_and_sample(
        self, chunks: list[ScheduledChunk], inputs: StepInputs, states: list[RequestState]
    ) -> SampledTokens:
        """The forward's inputs built on the CPU, then the one token for every sampler."""
        forward_batch = self._to_device(inputs)
        self.num_tokens_built += int(forward_batch.input_ids.shape[0])
        sampled = [self.token_id] * len(states)
        on_device = torch.full((len(states),), self.token_id, dtype=torch.int64)
        return SampledTokens([s.request_id for s in states], on_device, sampled)

    def _copy_blocks(self, pairs: list[tuple[int, int]]) -> None:
        """No KV cache: nothing to copy."""
