"""Fused element-wise steps of the decoder on the CPU (cpu_ops.cpp), float32 only.

A decode step on a CPU runs a few dozen rows through each layer; there the torch forms of
RMSNorm (eight ops), RoPE (five) and SiLU-and-multiply (two, with a strided result) cost more
in dispatch and passes over memory than in arithmetic. The C++ versions make one pass each, and
RoPE also writes the token's K and V into the paged cache. engine.attention.cpp_build builds them
at first use; `supports` says whether a model can use them (and CausalLM.use_fused_cpu_ops
switches it over), otherwise the decoder keeps its torch path.
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path

import torch
import torch.nn.functional as F

from engine.attention import cpp_build
from engine.models.config import ModelConfig

__all__ = ["rms_norm", "rope_write_kv", "silu_and_mul", "supports"]

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_ops.cpp")
_LANES = 8  # floats per vector in the kernels; RoPE works on half a head
_CHECK_TOLERANCE = 1e-5  # relative error of the load-time check against torch


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = cpp_build.load_library(SOURCE)
    if library is None:
        return None
    p, i64, f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float
    library.tiergate_rms_norm_f32.argtypes = [p, p, p, f32, i64, i64, p]
    library.tiergate_rope_write_kv_f32.argtypes = [p, i64, i64, i64, i64, i64, p, p, p, p, p, p]
    library.tiergate_silu_and_mul_f32.argtypes = [p, i64, i64, p]
    for function in ("rms_norm", "rope_write_kv", "silu_and_mul"):
        getattr(library, f"tiergate_{function}_f32").restype = None
    if not _agrees_with_torch(library):
        logger.warning("fused CPU ops disagree with torch; the decoder keeps its torch path")
        return None
    return library


def supports(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model of this config, device and dtype can run the fused ops (builds them)."""
    return (
        device.type == "cpu"
        and dtype == torch.float32
        and config.hidden_size % _LANES == 0
        and config.intermediate_size % _LANES == 0
        and config.head_dim % (2 * _LANES) == 0
        and _library() is not None
    )


def _lib() -> ctypes.CDLL:
    library = _library()
    assert library is not None, "supports() must be true before the fused ops are called"
    return library


def rms_norm(
    x: torch.Tensor,  # [T, E] contiguous
    weight: torch.Tensor,  # [E]
    eps: float,
    residual: torch.Tensor | None = None,  # [T, E] contiguous; += x in place, then normalised
) -> torch.Tensor:  # [T, E]
    """weight * x / rms(x); with residual, of residual + x (which residual then holds)."""
    num_rows, dim = x.shape
    out = torch.empty_like(x)
    _lib().tiergate_rms_norm_f32(
        x.data_ptr(), None if residual is None else residual.data_ptr(), weight.data_ptr(),
        eps, num_rows, dim, out.data_ptr(),
    )
    return out


def rope_write_kv(
    qkv: torch.Tensor,  # [T, (H + 2 Hkv) D] contiguous: q, k, v of each token; q, k rotated here
    num_heads: int,
    num_kv_heads: int,
    positions: torch.Tensor,  # int64[T]
    cos_table: torch.Tensor,  # [P, D] (RotaryTable.cos)
    sin_table: torch.Tensor,  # [P, D] (RotaryTable.sin)
    slot_mapping: torch.Tensor,  # int64[T]; -1: no cache write
    k_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
    v_cache: torch.Tensor,  # [num_blocks, block_size, Hkv, D]
) -> None:
    """Rotate q and k in place with RoPE, then write k and v into their cache slots."""
    head_dim = cos_table.shape[1]
    _lib().tiergate_rope_write_kv_f32(
        qkv.data_ptr(), qkv.stride(0), qkv.shape[0], num_heads, num_kv_heads, head_dim,
        positions.data_ptr(), cos_table.data_ptr(), sin_table.data_ptr(),
        slot_mapping.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
    )


def silu_and_mul(gate_up: torch.Tensor) -> torch.Tensor:  # [T, 2I] contiguous -> [T, I]
    """silu(gate) * up, gate and up being the halves of each row."""
    num_rows, width = gate_up.shape
    out = gate_up.new_empty((num_rows, width // 2))
    _lib().tiergate_silu_and_mul_f32(gate_up.data_ptr(), num_rows, width // 2, out.data_ptr())
    return out


def _agrees_with_torch(library: ctypes.CDLL) -> bool:
    """Each op once on random rows against its torch form (catches a miscompiled library)."""
    generator = torch.Generator().manual_seed(0)
    x, residual, weight = (torch.randn(3, 16, generator=generator) for _ in range(3))
    out = torch.empty_like(x)
    expected = F.rms_norm(x + residual, (16,), weight[0], 1e-5)
    library.tiergate_rms_norm_f32(x.data_ptr(), residual.data_ptr(), weight[0].data_ptr(), 1e-5,
                                  3, 16, out.data_ptr())
    errors = [(out - expected).norm() / expected.norm()]
    gate_up = torch.randn(3, 32, generator=generator)
    expected = F.silu(gate_up[:, :16]) * gate_up[:, 16:]
    library.tiergate_silu_and_mul_f32(gate_up.data_ptr(), 3, 16, out.data_ptr())
    errors.append((out - expected).norm() / expected.norm())
    return all(bool(error < _CHECK_TOLERANCE) for error in errors)
