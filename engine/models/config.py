"""The decoder's shape and per-architecture switches, read once from a HF config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from engine.errors import EngineError
from engine.models.registry import ArchitectureSpec, lookup_architecture


class ModelConfigError(EngineError):
    """A checkpoint the engine cannot run: unknown architecture, bad or missing fields."""


_DTYPES = {
    "float32": torch.float32,
    "float": torch.float32,
    "bfloat16": torch.bfloat16,
    "float16": torch.float16,
    "half": torch.float16,
}


@dataclass(frozen=True)
class RopeConfig:
    """Rotary position embedding: base frequency and optional context-extension scaling."""

    theta: float = 10000.0  # base wavelength
    scaling_type: str = "default"  # "default" | "linear" | "dynamic" | "llama3"
    factor: float = 1.0  # linear / dynamic / llama3 scaling factor
    low_freq_factor: float = 1.0  # llama3 only
    high_freq_factor: float = 4.0  # llama3 only
    original_max_position_embeddings: int = 8192  # llama3: pretraining context length


@dataclass(frozen=True)
class ModelConfig:
    """Everything the decoder, the loader and the FLOP estimate need to know about a model."""

    architecture: str  # HF class name, e.g. "LlamaForCausalLM"
    model_type: str  # HF model_type, e.g. "llama"
    vocab_size: int
    hidden_size: int
    intermediate_size: int  # MLP inner width
    num_layers: int
    num_heads: int  # query heads
    num_kv_heads: int  # key/value heads (GQA when fewer than num_heads)
    head_dim: int
    rms_norm_eps: float
    rope: RopeConfig
    max_position_embeddings: int  # the model's trained context length
    tie_word_embeddings: bool  # lm_head shares the embedding matrix
    has_qkv_bias: bool  # q/k/v projections carry a bias (Qwen2, attention_bias)
    has_o_bias: bool  # o_proj carries a bias (Llama/Qwen3 with attention_bias)
    has_mlp_bias: bool  # gate/up/down carry a bias (Llama mlp_bias)
    has_qk_norm: bool  # RMSNorm over head_dim on q and k before RoPE (Qwen3)
    sliding_windows: tuple[int | None, ...]  # per layer: keys kept (incl. self), None for all
    dtype: torch.dtype  # the checkpoint's dtype (torch_dtype / dtype), float32 if absent
    bos_token_id: int | None
    eos_token_ids: tuple[int, ...]  # config eos_token_id, as a tuple (may be empty)

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> ModelConfig:
        """Parse a HF config dict (transformers 4.x `rope_scaling` or 5.x `rope_parameters`)."""
        architectures = raw.get("architectures") or []
        spec = lookup_architecture(architectures, raw.get("model_type"))
        if spec is None:
            raise ModelConfigError(
                f"unsupported model: architectures={architectures}, "
                f"model_type={raw.get('model_type')!r}"
            )
        try:
            return _parse(raw, spec)
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelConfigError(f"bad model config: {exc}") from exc

    @classmethod
    def from_file(cls, path: str | Path) -> ModelConfig:
        """Read config.json (a file, or a model directory holding one)."""
        path = Path(path)
        if path.is_dir():
            path = path / "config.json"
        try:
            raw = json.loads(path.read_text())
        except (OSError, json.JSONDecodeError) as exc:
            raise ModelConfigError(f"cannot read model config {path}: {exc}") from exc
        return cls.from_dict(raw)


def _parse(raw: dict[str, Any], spec: ArchitectureSpec) -> ModelConfig:
    hidden_act = raw.get("hidden_act", "silu")
    if hidden_act != "silu":
        raise ModelConfigError(f"unsupported hidden_act {hidden_act!r} (only silu)")
    num_heads = int(raw["num_attention_heads"])
    num_kv_heads = int(raw.get("num_key_value_heads") or num_heads)
    if num_heads % num_kv_heads:
        raise ModelConfigError("num_attention_heads must be a multiple of num_key_value_heads")
    hidden_size = int(raw["hidden_size"])
    head_dim = int(raw.get("head_dim") or hidden_size // num_heads)
    num_layers = int(raw["num_hidden_layers"])
    attention_bias = bool(raw.get("attention_bias", False))
    eos = raw.get("eos_token_id")
    eos_ids = tuple(eos) if isinstance(eos, list) else (() if eos is None else (int(eos),))
    dtype_name = raw.get("torch_dtype") or raw.get("dtype") or "float32"
    if dtype_name not in _DTYPES:
        raise ModelConfigError(f"unsupported dtype {dtype_name!r}")
    return ModelConfig(
        architecture=spec.architecture,
        model_type=spec.model_type,
        vocab_size=int(raw["vocab_size"]),
        hidden_size=hidden_size,
        intermediate_size=int(raw["intermediate_size"]),
        num_layers=num_layers,
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        rms_norm_eps=float(raw.get("rms_norm_eps", 1e-6)),
        rope=_parse_rope(raw),
        max_position_embeddings=int(raw.get("max_position_embeddings", 4096)),
        tie_word_embeddings=bool(raw.get("tie_word_embeddings", False)),
        has_qkv_bias=spec.always_qkv_bias or attention_bias,
        has_o_bias=attention_bias and not spec.always_qkv_bias,
        has_mlp_bias=bool(raw.get("mlp_bias", False)),
        has_qk_norm=spec.has_qk_norm,
        sliding_windows=_parse_sliding_windows(raw, spec, num_layers),
        dtype=_DTYPES[dtype_name],
        bos_token_id=raw.get("bos_token_id"),
        eos_token_ids=eos_ids,
    )


def _parse_rope(raw: dict[str, Any]) -> RopeConfig:
    # transformers 5 folds rope_theta into rope_parameters; 4.x keeps rope_theta + rope_scaling.
    params = dict(raw.get("rope_parameters") or {})
    params.update(raw.get("rope_scaling") or {})
    theta = float(params.get("rope_theta", raw.get("rope_theta", 10000.0)))
    scaling_type = str(params.get("rope_type", params.get("type", "default")))
    if scaling_type not in ("default", "linear", "dynamic", "llama3"):
        raise ModelConfigError(f"unsupported rope scaling {scaling_type!r}")
    return RopeConfig(
        theta=theta,
        scaling_type=scaling_type,
        factor=float(params.get("factor", 1.0)),
        low_freq_factor=float(params.get("low_freq_factor", 1.0)),
        high_freq_factor=float(params.get("high_freq_factor", 4.0)),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings", raw.get("max_position_embeddings", 8192))
        ),
    )


def _parse_sliding_windows(
    raw: dict[str, Any], spec: ArchitectureSpec, num_layers: int
) -> tuple[int | None, ...]:
    window = raw.get("sliding_window")
    if spec.window_switch is not None and not raw.get(spec.window_switch, False):
        window = None  # Qwen2/3 carry a sliding_window value that is off unless switched on
    if window is None:
        return (None,) * num_layers
    window = int(window)
    if spec.window_switch is None:
        return (window,) * num_layers  # Mistral: every layer slides
    layer_types = raw.get("layer_types")
    if layer_types is None:
        # Qwen2/3 configs without layer_types: layers from max_window_layers on slide.
        first = int(raw.get("max_window_layers", num_layers))
        layer_types = [
            "sliding_attention" if i >= first else "full_attention" for i in range(num_layers)
        ]
    if len(layer_types) != num_layers:
        raise ModelConfigError("layer_types must have one entry per layer")
    return tuple(window if t == "sliding_attention" else None for t in layer_types)
