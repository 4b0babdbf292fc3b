"""Llama 3.1-style rope scaling from a GGUF file's per-frequency factors (`rope_freqs.weight`).

HF configs describe Llama 3.1/3.2's context extension with four numbers (`rope_type: llama3`:
factor, low_freq_factor, high_freq_factor, original_max_position_embeddings); llama.cpp's
converter evaluates them into one divisor per rotary frequency and stores only those. Each
divisor is 1 for short wavelengths, `factor` for long ones, and between them
1 / ((1 - s) / factor + s) with s = old / ((high - low) w) - low / (high - low) for wavelength
w: a line in 1 / w with slope A = old / (high - low) and intercept B = low / (high - low).

`llama3_scaling` recovers the four numbers: `factor` is the largest divisor, A and B come from
the divisors between (a least-squares line in 1 / w), and with low = 1 (Llama 3.1's value)
old = A / B (a whole number) and high = 1 + 1 / B, refitted for that old. One or no divisor
between leaves the edges undetermined; they are put among the wavelengths then, which gives
the same divisors for every frequency the model has. The result is accepted only if the
engine's own llama3 scaling gives back every stored divisor; a file whose divisors follow
no such curve is refused, never served with different rotary angles.
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from engine.models.config import ModelConfigError, RopeConfig
from engine.models.rope import inverse_frequencies

__all__ = ["llama3_scaling"]

_SAME = 1e-4  # relative difference under which two divisors are taken as equal
_CHECK_RTOL = 1e-5  # the recovered scaling must give back every divisor this closely


def llama3_scaling(divisors: np.ndarray, theta: float, head_dim: int) -> dict[str, Any] | None:
    """The HF `rope_scaling` (llama3) whose divisors are `divisors` (one per rotary frequency,
    float32[head_dim / 2]); None when every divisor is 1 (no scaling)."""
    divisors = np.asarray(divisors, dtype=np.float64).reshape(-1)
    if divisors.shape[0] != head_dim // 2:
        raise ModelConfigError(
            f"rope_freqs.weight holds {divisors.shape[0]} factors for {head_dim // 2} rotary "
            "frequencies"
        )
    if not (np.all(np.isfinite(divisors)) and divisors.min() > 0):
        raise ModelConfigError("rope_freqs.weight holds factors that are not positive numbers")
    factor = float(divisors.max())
    if factor <= 1 + _SAME:
        return None
    base = inverse_frequencies(RopeConfig(theta=theta), head_dim).double().numpy()
    wavelengths = 2 * math.pi / base  # increasing
    is_one = np.abs(divisors - 1) <= _SAME
    is_full = np.abs(divisors - factor) <= _SAME * factor
    between = ~(is_one | is_full)
    old, high = _edges(wavelengths, divisors, factor, is_one, is_full, between)
    scaling = {
        "rope_type": "llama3",
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": high,
        "original_max_position_embeddings": old,
    }
    _check(scaling, theta, head_dim, base, divisors)
    return scaling


def _edges(
    wavelengths: np.ndarray, divisors: np.ndarray, factor: float,
    is_one: np.ndarray, is_full: np.ndarray, between: np.ndarray,
) -> tuple[int, float]:
    """original_max_position_embeddings and high_freq_factor, low_freq_factor being 1: then
    s = (old / w - 1) / (high - 1), the long edge is at old and the short one at old / high."""
    s = (1 / divisors[between] - 1 / factor) / (1 - 1 / factor)
    middle = wavelengths[between]
    if between.sum() >= 2:
        # s = A / w - B; old = A / B, then high refitted for the whole number old
        design = np.stack([1 / middle, -np.ones(len(middle))], axis=1)
        (slope, intercept), *_ = np.linalg.lstsq(design, s, rcond=None)
        if not (slope > 0 and intercept > 0):
            raise _refused("the factors do not rise with the wavelength")
        old = round(float(slope / intercept))
        x = old / middle - 1
        return old, 1 + float(np.dot(x, x) / np.dot(s, x))
    # Too few divisors between the edges to place them: put them among the wavelengths that
    # have none (any such place gives the model's frequencies the same divisors).
    if not is_one.any() or not is_full.any():
        raise _refused("no wavelength keeps its frequency, or none is scaled fully")
    longest_one = float(wavelengths[is_one].max())
    shortest_full = float(wavelengths[is_full].min())
    if between.any():
        old = round(math.sqrt(float(middle[0]) * shortest_full))
        return old, 1 + (old / float(middle[0]) - 1) / float(s[0])
    old = round(longest_one * (shortest_full / longest_one) ** (2 / 3))
    return old, old / (longest_one * (shortest_full / longest_one) ** (1 / 3))


def _check(
    scaling: dict[str, Any], theta: float, head_dim: int, base: np.ndarray, divisors: np.ndarray
) -> None:
    rope = RopeConfig(
        theta=theta,
        scaling_type="llama3",
        factor=scaling["factor"],
        low_freq_factor=scaling["low_freq_factor"],
        high_freq_factor=scaling["high_freq_factor"],
        original_max_position_embeddings=scaling["original_max_position_embeddings"],
    )
    scaled = inverse_frequencies(rope, head_dim).double().numpy()
    if not np.allclose(base / scaled, divisors, rtol=_CHECK_RTOL, atol=0):
        raise _refused("no llama3 rope scaling gives them back")


def _refused(why: str) -> ModelConfigError:
    return ModelConfigError(f"per-frequency rope factors (rope_freqs.weight) not read: {why}")
