"""Quantized HF checkpoints written from float weights, in the published layouts.

A small min/max group quantizer (asymmetric, or symmetric with zero point 2^(bits-1)), and
packers that follow each format's description word by word, written apart from the engine's
repacking (engine.models.quantized.layouts) so that the tests compare two readings of it:

- AWQ GEMM: qweight int32 [K, N/8], output 8c + AWQ_ORDER[i] in nibble i of word c;
  qzeros int32 [K/G, N/8] alike; scales float16 [K/G, N].
- GPTQ: qweight int32 [K*bits/32, N], input (32/bits) r + i in field i of row r; qzeros int32
  [K/G, N*bits/32], output (32/bits) c + i in field i of word c, v1 storing zero - 1 modulo
  2^bits; scales float16 [K/G, N]; g_idx int32 [K].
- fp8: weight float8_e4m3fn [N, K], weight_scale float32 [] (per tensor) or [N, 1].
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

from engine.models.config import ModelConfig
from engine.models.loader import random_hf_state_dict
from tests.engine.models.helpers import HF_CONFIGS

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
FP8_MAX = 448.0
PROJECTIONS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


@dataclass(frozen=True)
class GroupQuantized:
    """W^T [K, N] as integers: W[n, k] ~ (q[k, n] - zeros[k // G, n]) * scales[k // G, n]."""

    q: torch.Tensor  # int64 [K, N]
    zeros: torch.Tensor  # int64 [K/G, N]
    scales: torch.Tensor  # float16 [K/G, N]
    group_size: int

    def dequantized(self) -> torch.Tensor:  # float32 [N, K]
        g = self.group_size
        zeros = self.zeros.repeat_interleave(g, dim=0)
        scales = self.scales.float().repeat_interleave(g, dim=0)
        return ((self.q - zeros).float() * scales).t().contiguous()


def quantize_groups(weight: torch.Tensor, bits: int, group_size: int,
                    symmetric: bool = False) -> GroupQuantized:
    """Round-to-nearest min/max quantization of weight [N, K] in groups of inputs."""
    maxq = (1 << bits) - 1
    wt = weight.t().float()  # [K, N]
    groups = wt.reshape(-1, group_size, wt.shape[1])  # [K/G, G, N]
    low, high = groups.amin(1), groups.amax(1)
    if symmetric:
        bound = torch.maximum(low.abs(), high.abs()).clamp_min(1e-8)
        scales = (2 * bound / maxq).half()
        zeros = torch.full_like(low, 1 << (bits - 1), dtype=torch.int64)
    else:
        scales = ((high - low).clamp_min(1e-8) / maxq).half()
        zeros = torch.round(-low / scales.float()).clamp(0, maxq).long()
    q = torch.round(groups / scales.float().unsqueeze(1)) + zeros.unsqueeze(1)
    q = q.clamp(0, maxq).long().reshape(wt.shape)
    return GroupQuantized(q, zeros, scales, group_size)


def _to_int32(words: torch.Tensor) -> torch.Tensor:
    """int64 words below 2^32 -> int32 with the same bits."""
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def awq_tensors(quantized: GroupQuantized) -> dict[str, torch.Tensor]:
    def pack(values: torch.Tensor) -> torch.Tensor:  # [R, N] -> [R, N/8]
        words = torch.zeros(values.shape[0], values.shape[1] // 8, dtype=torch.int64)
        for c in range(words.shape[1]):
            for i, column in enumerate(AWQ_ORDER):
                words[:, c] |= values[:, 8 * c + column] << (4 * i)
        return _to_int32(words)

    return {"qweight": pack(quantized.q), "qzeros": pack(quantized.zeros),
            "scales": quantized.scales}


def gptq_tensors(quantized: GroupQuantized, bits: int, v1: bool = True,
                 ) -> dict[str, torch.Tensor]:
    per_word, mask = 32 // bits, (1 << bits) - 1
    q, num_in = quantized.q, quantized.q.shape[0]
    qweight = torch.zeros(num_in // per_word, q.shape[1], dtype=torch.int64)
    for r in range(qweight.shape[0]):
        for i in range(per_word):
            qweight[r] |= q[per_word * r + i] << (bits * i)
    stored_zeros = (quantized.zeros - 1) & mask if v1 else quantized.zeros
    qzeros = torch.zeros(stored_zeros.shape[0], stored_zeros.shape[1] // per_word,
                         dtype=torch.int64)
    for c in range(qzeros.shape[1]):
        for i in range(per_word):
            qzeros[:, c] |= stored_zeros[:, per_word * c + i] << (bits * i)
    g_idx = (torch.arange(num_in) // quantized.group_size).to(torch.int32)
    return {"qweight": _to_int32(qweight), "qzeros": _to_int32(qzeros),
            "scales": quantized.scales, "g_idx": g_idx}


def fp8_tensors(weight: torch.Tensor, per_channel: bool) -> dict[str, torch.Tensor]:
    """weight [N, K] scaled so its largest magnitude (per row, or overall) is fp8's largest."""
    amax = weight.abs().amax(dim=1, keepdim=True) if per_channel else weight.abs().amax()
    scale = (amax.float() / FP8_MAX).clamp_min(1e-12)
    stored = (weight / scale).clamp(-FP8_MAX, FP8_MAX).to(torch.float8_e4m3fn)
    return {"weight": stored, "weight_scale": scale}


def fp8_dequantized(tensors: dict[str, torch.Tensor]) -> torch.Tensor:  # float32 [N, K]
    return tensors["weight"].float() * tensors["weight_scale"]


@dataclass(frozen=True)
class QuantizedCheckpoint:
    """A checkpoint directory, and the float32 tensors its quantized ones stand for."""

    path: Path
    config: ModelConfig
    dequantized: dict[str, torch.Tensor]  # HF name -> float32, every tensor of the model


def quantization_config(method: str, bits: int = 4, group_size: int = 32,
                        **extra: Any) -> dict[str, Any]:
    if method == "awq":
        base: dict[str, Any] = {"quant_method": "awq", "bits": 4, "group_size": group_size,
                                "zero_point": True, "version": "gemm"}
    elif method == "gptq":
        base = {"quant_method": "gptq", "bits": bits, "group_size": group_size,
                "desc_act": False, "sym": False}
    else:
        base = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    return base | extra


def write_quantized_checkpoint(path: Path, variant: str, method: str, bits: int = 4,
                               group_size: int = 32, seed: int = 0, per_channel: bool = True,
                               symmetric: bool = False, v1: bool = True) -> QuantizedCheckpoint:
    """The tiny random model of `variant` (tests.engine.models.helpers.HF_CONFIGS), its
    projections in decoder layers quantized by `method`, written as two safetensors shards
    with an index (so a projection's tensors may sit in different files)."""
    quant = quantization_config(method, bits, group_size, sym=symmetric) if method == "gptq" \
        else quantization_config(method, bits, group_size)
    if method == "gptq" and not v1:
        quant["checkpoint_format"] = "gptq_v2"
    raw = HF_CONFIGS[variant]().to_dict() | {"quantization_config": quant}
    config = ModelConfig.from_dict(raw)
    state = random_hf_state_dict(config, seed)
    generator = torch.Generator().manual_seed(seed + 1)
    for name in state:
        if name.endswith(".bias"):  # random, so that biases matter
            state[name] = torch.randn(state[name].shape, generator=generator) * 0.1
    tensors: dict[str, torch.Tensor] = {}
    dequantized: dict[str, torch.Tensor] = {}
    for name, tensor in state.items():
        module, _, kind = name.rpartition(".")
        if kind != "weight" or module.rpartition(".")[2] not in PROJECTIONS:
            tensors[name] = dequantized[name] = tensor
            continue
        if method == "fp8":
            parts = fp8_tensors(tensor, per_channel)
            dequantized[name] = fp8_dequantized(parts)
        else:
            quantized = quantize_groups(tensor, bits, group_size, symmetric)
            parts = awq_tensors(quantized) if method == "awq" else \
                gptq_tensors(quantized, bits, v1)
            dequantized[name] = quantized.dequantized()
        tensors |= {f"{module}.{part}": value for part, value in parts.items()}
    _save_sharded(path, tensors)
    (path / "config.json").write_text(json.dumps(raw))
    return QuantizedCheckpoint(path, config, dequantized)


def _save_sharded(path: Path, tensors: dict[str, torch.Tensor]) -> None:
    names = sorted(tensors)
    files = {"model-00001-of-00002.safetensors": names[1::2],  # every other name: parts of a
             "model-00002-of-00002.safetensors": names[0::2]}  # projection in both files
    weight_map: dict[str, str] = {}
    for file, chunk in files.items():
        save_file({n: tensors[n].contiguous() for n in chunk}, path / file)
        weight_map |= dict.fromkeys(chunk, file)
    index = {"metadata": {}, "weight_map": weight_map}
    (path / "model.safetensors.index.json").write_text(json.dumps(index))
