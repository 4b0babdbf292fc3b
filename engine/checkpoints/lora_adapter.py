"""A PEFT LoRA adapter read and checked against the base model it is for.

An adapter is a directory (or its two files): `adapter_config.json` and
`adapter_model.safetensors`. Safetensors only: a pickled `adapter_model.bin` is refused
unread. Every check runs before anything is kept, and each refusal names the problem
(`AdapterError`): the PEFT type, DoRA, trained biases, extra modules saved whole, a target
other than the seven projections, a tensor that is not a projection's A or B, a layer the
base model lacks, a shape that does not fit the base model, a rank above the limit, a
non-finite weight, a file over the size limit.

PEFT's forward for a target is `y = W x + s * B (A x)`, with s = lora_alpha / r (rsLoRA:
lora_alpha / sqrt(r)), per-module ranks and alphas from `rank_pattern` / `alpha_pattern`.
`LoraAdapter` keeps A and B in float32 with s folded into B.
"""

from __future__ import annotations

import json
import math
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from safetensors import SafetensorError, safe_open

from engine.models.config import ModelConfig
from engine.models.lora import target_shapes

__all__ = [
    "ADAPTER_CONFIG",
    "ADAPTER_WEIGHTS",
    "MODULE_BLOCK",
    "TARGET_MODULES",
    "AdapterError",
    "LoraAdapter",
    "read_lora_adapter",
]

ADAPTER_CONFIG = "adapter_config.json"
ADAPTER_WEIGHTS = "adapter_model.safetensors"
_PICKLED_WEIGHTS = ("adapter_model.bin", "adapter_model.pt", "adapter_model.pth")
# The projections an adapter may target, by their HF module names.
TARGET_MODULES = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")
MODULE_BLOCK = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn",
                "o_proj": "self_attn", "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
_KEY = re.compile(
    r"^(?:base_model\.model\.)?model\.layers\.(\d+)\.(self_attn|mlp)\."
    r"(q_proj|k_proj|v_proj|o_proj|gate_proj|up_proj|down_proj)\.lora_([AB])(?:\.default)?\.weight$"
)
_FLOAT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
DEFAULT_MAX_BYTES = 2 << 30


class AdapterError(ValueError):
    """An adapter that cannot be served; the message names the problem."""


@dataclass(frozen=True)
class LoraTarget:
    """One adapted projection of one layer: y += b @ (a @ x), scaling folded into b."""

    a: torch.Tensor  # float32 [r, in]
    b: torch.Tensor  # float32 [out, r], times the scaling


@dataclass
class LoraAdapter:
    """An adapter's weights, checked against its base model."""

    rank: int  # the largest rank of its targets
    targets: tuple[str, ...]  # the module names it adapts (a subset of TARGET_MODULES)
    layers: list[dict[str, LoraTarget]]  # per base-model layer: module name -> its A and B

    @property
    def nbytes(self) -> int:
        return sum(t.a.nbytes + t.b.nbytes for layer in self.layers for t in layer.values())


def _pattern_value(patterns: dict[str, Any], module_path: str, default: float) -> float:
    """PEFT's rank_pattern / alpha_pattern lookup: the first key that matches the end of the
    module's path."""
    for pattern, value in patterns.items():
        if re.fullmatch(rf"(?:.*\.)?(?:{pattern})", module_path):
            return float(value)
    return default


def _read_config(path: Path) -> dict[str, Any]:
    try:
        config = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as exc:
        raise AdapterError(f"{ADAPTER_CONFIG} is not readable JSON ({exc})") from None
    if not isinstance(config, dict):
        raise AdapterError(f"{ADAPTER_CONFIG} is not a JSON object")
    peft_type = config.get("peft_type", "LORA")
    if peft_type != "LORA":
        raise AdapterError(f"peft_type {peft_type!r} is not supported (LORA only)")
    if config.get("use_dora"):
        raise AdapterError("DoRA adapters (use_dora) are not supported")
    if config.get("bias", "none") != "none":
        raise AdapterError("adapters that train biases (bias != 'none') are not supported")
    if config.get("modules_to_save"):
        raise AdapterError("modules_to_save is not supported: an adapter may only add "
                           f"low-rank updates to {', '.join(TARGET_MODULES)}")
    if config.get("fan_in_fan_out"):
        raise AdapterError("fan_in_fan_out adapters are not supported")
    for key in ("r", "lora_alpha"):
        value = config.get(key)
        if isinstance(value, bool) or not isinstance(value, int | float) or value <= 0:
            raise AdapterError(f"{ADAPTER_CONFIG}: {key} must be a positive number")
    for key in ("rank_pattern", "alpha_pattern"):
        if not isinstance(config.get(key) or {}, dict):
            raise AdapterError(f"{ADAPTER_CONFIG}: {key} must be an object")
    targets = config.get("target_modules")
    if isinstance(targets, list):
        unknown = sorted(str(t) for t in targets if t not in TARGET_MODULES)
        if unknown:
            raise AdapterError(f"target modules {unknown} are not supported (only "
                               f"{', '.join(TARGET_MODULES)})")
    return config


def read_lora_adapter(
    path: str | Path, config: ModelConfig, max_rank: int, max_bytes: int = DEFAULT_MAX_BYTES
) -> LoraAdapter:
    """Read and check the adapter at path (a directory) for a base model of this config."""
    directory = Path(path)
    if not directory.is_dir():
        raise AdapterError("the adapter path is not a directory")
    weights_path = directory / ADAPTER_WEIGHTS
    if not weights_path.is_file():
        pickled = [name for name in _PICKLED_WEIGHTS if (directory / name).exists()]
        if pickled:
            raise AdapterError(f"{pickled[0]} is a pickle: only {ADAPTER_WEIGHTS} is accepted")
        raise AdapterError(f"{ADAPTER_WEIGHTS} is missing")
    if not (directory / ADAPTER_CONFIG).is_file():
        raise AdapterError(f"{ADAPTER_CONFIG} is missing")
    size = weights_path.stat().st_size
    if size > max_bytes:
        raise AdapterError(f"{ADAPTER_WEIGHTS} is {size} bytes, over the limit of {max_bytes}")
    adapter_config = _read_config(directory / ADAPTER_CONFIG)
    shapes = target_shapes(config)
    use_rslora = bool(adapter_config.get("use_rslora"))
    rank_pattern = adapter_config.get("rank_pattern") or {}
    alpha_pattern = adapter_config.get("alpha_pattern") or {}
    default_alpha = float(adapter_config["lora_alpha"])
    pairs: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    try:
        with safe_open(str(weights_path), framework="pt") as tensors:
            for key in tensors.keys():  # noqa: SIM118 (safe_open is no mapping)
                match = _KEY.match(key)
                if match is None:
                    raise AdapterError(f"tensor {key!r} is not the A or B of a supported "
                                       "projection")
                layer, block, module, side = match.groups()
                if block != MODULE_BLOCK[module]:
                    raise AdapterError(f"tensor {key!r}: {module} is not in {block}")
                pairs.setdefault((int(layer), module), {})[side] = tensors.get_tensor(key)
    except SafetensorError as exc:
        raise AdapterError(f"{ADAPTER_WEIGHTS} is not a valid safetensors file ({exc})") from None
    if not pairs:
        raise AdapterError(f"{ADAPTER_WEIGHTS} holds no LoRA weights")
    layers: list[dict[str, LoraTarget]] = [{} for _ in range(config.num_layers)]
    rank = 0
    for (layer, module), sides in sorted(pairs.items()):
        where = f"layer {layer} {module}"
        if layer >= config.num_layers:
            raise AdapterError(f"{where}: the base model has {config.num_layers} layers")
        if set(sides) != {"A", "B"}:
            raise AdapterError(f"{where}: lora_A and lora_B must both be present")
        a, b = sides["A"], sides["B"]
        if a.dtype not in _FLOAT_DTYPES or b.dtype not in _FLOAT_DTYPES:
            raise AdapterError(f"{where}: weights must be float32, float16 or bfloat16")
        num_in, num_out = shapes[module]
        r = a.shape[0] if a.dim() == 2 else -1
        if a.dim() != 2 or b.dim() != 2 or a.shape[1] != num_in or b.shape != (num_out, r):
            raise AdapterError(
                f"{where}: A {tuple(a.shape)} and B {tuple(b.shape)} do not fit the base "
                f"model ({num_out} x {num_in}): is the adapter for another base model?")
        if r > max_rank:
            raise AdapterError(f"{where}: rank {r} is above the limit of {max_rank}")
        module_path = f"model.layers.{layer}.{MODULE_BLOCK[module]}.{module}"
        expected_rank = _pattern_value(rank_pattern, module_path, float(adapter_config["r"]))
        if r != int(expected_rank):
            raise AdapterError(f"{where}: rank {r} is not the configured rank "
                               f"{int(expected_rank)}")
        a32, b32 = a.float(), b.float()
        if not (bool(torch.isfinite(a32).all()) and bool(torch.isfinite(b32).all())):
            raise AdapterError(f"{where}: weights hold NaN or infinity")
        alpha = _pattern_value(alpha_pattern, module_path, default_alpha)
        scaling = alpha / math.sqrt(r) if use_rslora else alpha / r
        layers[layer][module] = LoraTarget(a32.contiguous(), (b32 * scaling).contiguous())
        rank = max(rank, r)
    targets = tuple(m for m in TARGET_MODULES if any(m in layer for layer in layers))
    return LoraAdapter(rank=rank, targets=targets, layers=layers)
