"""Model FLOPs of a forward pass: the one formula metering and benchmarks share.

Linear layers cost 2 FLOPs per weight per token (q/k/v/o, gate/up/down of every layer); the
lm_head only for tokens whose logits are computed (the runner computes logits for sampled
rows only). Attention costs 4 * head_dim * num_heads FLOPs per (query token, visible key) per
layer: QK^T and PV, 2 FLOPs per multiply-add each. Embedding lookups, norms, RoPE and softmax
are ignored (they are memory-bound and small).
"""

from __future__ import annotations

from collections import Counter

import numpy as np

from engine.models.config import ModelConfig

__all__ = ["FlopsCounter", "forward_flops", "linear_params_per_token"]


def linear_params_per_token(config: ModelConfig) -> int:
    """Weights of the decoder layers' linear projections (without the lm_head)."""
    e = config.hidden_size
    attention = e * (config.q_size + 2 * config.kv_size) + config.q_size * e
    mlp = 3 * e * config.intermediate_size
    return config.num_layers * (attention + mlp)


def _visible_keys(num_new: np.ndarray, num_context: np.ndarray, window: int | None) -> np.ndarray:
    """Per chunk, the sum over its new tokens of the keys each attends to (itself included)."""
    first = num_context - num_new + 1  # context of the first new token
    unclipped = (first + num_context) * num_new // 2
    if window is None:
        return unclipped
    # Contexts first..window grow, window+1..last are clipped to window.
    partial = (first + window) * (window - first + 1) // 2 + window * (num_context - window)
    return np.where(window >= num_context, unclipped,
                    np.where(window <= first, window * num_new, partial))


def forward_flops(
    config: ModelConfig, num_new_tokens: int, num_context_tokens: int, num_sampled_tokens: int
) -> float:
    """FLOPs to compute num_new_tokens ending at num_context_tokens of context (cached prefix
    plus the new tokens), with lm_head logits for num_sampled_tokens of them."""
    return FlopsCounter(config)(num_new_tokens, num_context_tokens, num_sampled_tokens)


class FlopsCounter:
    """forward_flops of one model with its constants worked out once (metering asks it for
    every chunk of every step): layers with the same window are counted together."""

    def __init__(self, config: ModelConfig) -> None:
        self._linear = 2 * linear_params_per_token(config)
        self._lm_head = 2 * config.hidden_size * config.vocab_size
        self._per_key = 4 * config.head_dim * config.num_heads
        self._layers_by_window = list(Counter(config.sliding_windows).items())

    def __call__(
        self, num_new_tokens: int, num_context_tokens: int, num_sampled_tokens: int = 1
    ) -> float:
        return float(self.many(np.array([num_new_tokens]), np.array([num_context_tokens]),
                               np.array([num_sampled_tokens]))[0])

    def many(
        self, num_new: np.ndarray, num_context: np.ndarray, num_sampled: np.ndarray
    ) -> np.ndarray:
        """The same for many chunks at once: int64 arrays in, float64[len] out (metering's
        estimator, engine.metering.FlopsEstimator)."""
        keys = np.zeros_like(num_new)
        for window, num_layers in self._layers_by_window:
            keys += num_layers * _visible_keys(num_new, num_context, window)
        flops = self._linear * num_new + self._lm_head * num_sampled + self._per_key * keys
        flops *= num_new > 0  # no new token, no cost
        return flops.astype(np.float64)
