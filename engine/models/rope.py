"""Rotary position embeddings (HF "rotate half" layout) with a precomputed cos/sin table."""

from __future__ import annotations

import math

import torch

from engine.models.config import RopeConfig


def inverse_frequencies(rope: RopeConfig, head_dim: int) -> torch.Tensor:  # float32[D/2]
    """Per-pair inverse frequencies for default, linear and llama3 scaling (as HF computes them)."""
    exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
    inv_freq = 1.0 / (rope.theta**exponents)
    if rope.scaling_type == "linear":
        return inv_freq / rope.factor
    if rope.scaling_type == "llama3":
        return _llama3_scale(inv_freq, rope)
    return inv_freq


def _llama3_scale(inv_freq: torch.Tensor, rope: RopeConfig) -> torch.Tensor:
    old_len = rope.original_max_position_embeddings
    low_freq_wavelen = old_len / rope.low_freq_factor
    high_freq_wavelen = old_len / rope.high_freq_factor
    wavelen = 2 * math.pi / inv_freq
    # Long wavelengths are divided by factor, short ones kept, the middle band interpolated.
    scaled = torch.where(wavelen > low_freq_wavelen, inv_freq / rope.factor, inv_freq)
    smooth = (old_len / wavelen - rope.low_freq_factor) / (
        rope.high_freq_factor - rope.low_freq_factor
    )
    smoothed = (1 - smooth) * scaled / rope.factor + smooth * scaled
    is_medium = ~(wavelen < high_freq_wavelen) * ~(wavelen > low_freq_wavelen)
    return torch.where(is_medium, smoothed, scaled)


def _dynamic_angles(
    rope: RopeConfig, head_dim: int, max_position_embeddings: int, positions: torch.Tensor
) -> torch.Tensor:  # float32[P, D/2]
    """Dynamic NTK: position p uses the base HF would use for a sequence of p + 1 tokens.

    Up to max_position_embeddings this is the unscaled base, so short contexts match HF
    exactly; beyond it every token keeps the encoding it got when it was generated (HF
    re-encodes the whole batch at the batch's longest length instead, which a paged cache
    that never rewrites keys cannot do).
    """
    angles = positions.to(torch.float32)[:, None] * inverse_frequencies(rope, head_dim)[None, :]
    long = positions >= max_position_embeddings
    if bool(long.any()):
        # float32 throughout, in HF's order of operations.
        seq_lens = (positions[long] + 1).to(torch.float32)
        factor = rope.factor
        bases = rope.theta * ((factor * seq_lens / max_position_embeddings) - (factor - 1)) ** (
            head_dim / (head_dim - 2)
        )
        exponents = torch.arange(0, head_dim, 2, dtype=torch.int64).to(torch.float32) / head_dim
        inv_freq = 1.0 / bases[:, None] ** exponents[None, :]
        angles[long] = positions[long].to(torch.float32)[:, None] * inv_freq
    return angles


class RotaryTable:
    """cos/sin for every position below max_positions, laid out for `apply_rope`."""

    def __init__(
        self,
        rope: RopeConfig,
        head_dim: int,
        max_positions: int,
        max_position_embeddings: int,
        dtype: torch.dtype,
        device: torch.device,
    ) -> None:
        positions = torch.arange(max_positions, dtype=torch.int64)
        if rope.scaling_type == "dynamic":
            angles = _dynamic_angles(rope, head_dim, max_position_embeddings, positions)
        else:
            inv_freq = inverse_frequencies(rope, head_dim)
            angles = positions.to(torch.float32)[:, None] * inv_freq[None, :]  # [P, D/2]
        cos, sin = angles.cos(), angles.sin()
        # [P, D]: cos duplicated over both halves; sin signed so that
        # x * cos + swap_halves(x) * sin == HF's x * cos + rotate_half(x) * sin.
        self.cos = torch.cat([cos, cos], dim=-1).to(dtype=dtype, device=device)
        self.sin = torch.cat([-sin, sin], dim=-1).to(dtype=dtype, device=device)
        self.max_positions = max_positions

    def lookup(self, positions: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """cos, sin: [T, 1, D] for int64 positions [T], broadcastable over heads."""
        return self.cos[positions].unsqueeze(1), self.sin[positions].unsqueeze(1)


def apply_rope(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x: [T, N, D] -> [T, N, D]; cos, sin: [T, 1, D] from RotaryTable.lookup."""
    half = x.shape[-1] // 2
    swapped = torch.cat([x[..., half:], x[..., :half]], dim=-1)  # [T, N, D]
    return torch.addcmul(x * cos, swapped, sin)
