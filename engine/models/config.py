"""The decoder's shape and per-architecture switches, read once from a HF config.json."""

from __future__ import annotations

import json
from dataclasses import dataclass, replace
from enum import StrEnum
from pathlib import Path
from typing import Any

import torch

from engine.errors import EngineError
from engine.models.registry import ArchitectureSpec, lookup_architecture


class ModelConfigError(EngineError):
    """A checkpoint the engine cannot run: unknown architecture, bad or missing fields."""


class QuantizationConfigError(ModelConfigError, ValueError):
    """A config.json `quantization_config` the engine cannot serve (method or option)."""


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


class QuantMethod(StrEnum):
    """The weight-only quantized checkpoint formats served as stored (engine.models.quantized)."""

    AWQ = "awq"  # AutoAWQ GEMM: int4, group scales and zero points, packed along outputs
    GPTQ = "gptq"  # int4/int8, group scales and zero points, packed along inputs
    FP8 = "fp8"  # float8_e4m3fn weights, per-tensor or per-channel float32 scales


@dataclass(frozen=True)
class QuantizationConfig:
    """A checkpoint's `quantization_config`, validated: what the quantized linears hold."""

    method: QuantMethod
    bits: int  # bits per weight: 4 or 8
    group_size: int  # input features per scale and zero point; 0 for fp8 (no groups)
    zero_offset: int  # added to stored zero points: 1 for GPTQ v1 (stores zero - 1), else 0

    @property
    def name(self) -> str:
        """How the served weights are named, e.g. "awq-int4-g128" or "fp8-e4m3"."""
        if self.method is QuantMethod.FP8:
            return "fp8-e4m3"
        return f"{self.method}-int{self.bits}-g{self.group_size}"


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
    quantization: QuantizationConfig | None = None  # quantized linears; None: float weights

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
            config = _parse(raw, spec)
        except (KeyError, TypeError, ValueError) as exc:
            raise ModelConfigError(f"bad model config: {exc}") from exc
        quantization = raw.get("quantization_config")
        if quantization is None:
            return config
        return replace(config, quantization=_parse_quantization(quantization))

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


_GROUP_SIZES = (32, 64, 128)


def _parse_quantization(raw: dict[str, Any]) -> QuantizationConfig:
    """AWQ (GEMM), GPTQ (no act-order) and dynamic fp8, as HF transformers writes them."""
    method = str(raw.get("quant_method", "")).lower()

    def refuse(option: str, value: Any, supported: str) -> QuantizationConfigError:
        return QuantizationConfigError(
            f"quantization_config: {method} with {option}={value!r} is not supported "
            f"({supported})")

    if method == QuantMethod.FP8:
        if raw.get("activation_scheme", "dynamic") != "dynamic":
            raise refuse("activation_scheme", raw.get("activation_scheme"),
                          "only dynamic: weights are served as stored, activations as they are")
        if raw.get("weight_block_size") is not None:
            raise refuse("weight_block_size", raw["weight_block_size"],
                          "per-tensor or per-channel weight scales only")
        if raw.get("fmt", "e4m3") != "e4m3":
            raise refuse("fmt", raw.get("fmt"), "e4m3 only")
        return QuantizationConfig(QuantMethod.FP8, bits=8, group_size=0, zero_offset=0)
    if method not in (QuantMethod.AWQ, QuantMethod.GPTQ):
        raise QuantizationConfigError(
            f"quantization_config: unsupported quant_method {raw.get('quant_method')!r} "
            f"(supported: {', '.join(m.value for m in QuantMethod)})")
    bits, group_size = raw.get("bits", raw.get("w_bit")), raw.get("group_size",
                                                                   raw.get("q_group_size"))
    if group_size not in _GROUP_SIZES:
        raise refuse("group_size", group_size, f"one of {_GROUP_SIZES}")
    if method == QuantMethod.AWQ:
        if bits != 4:
            raise refuse("bits", bits, "4 only")
        if not raw.get("zero_point", True):
            raise refuse("zero_point", raw.get("zero_point"), "zero points required")
        version = str(raw.get("version", "gemm")).lower()
        if version != "gemm":
            raise refuse("version", raw.get("version"), "the GEMM layout only")
        return QuantizationConfig(QuantMethod.AWQ, bits=4, group_size=group_size, zero_offset=0)
    if bits not in (4, 8):
        raise refuse("bits", bits, "4 or 8")
    if raw.get("desc_act", False):
        raise refuse("desc_act", raw["desc_act"], "no act-order: groups of consecutive inputs")
    checkpoint_format = str(raw.get("checkpoint_format", "gptq")).lower()
    if checkpoint_format not in ("gptq", "gptq_v2") or raw.get("is_marlin_format", False):
        raise refuse("checkpoint_format", raw.get("checkpoint_format", "marlin"),
                      "gptq (v1, zero points stored minus one) or gptq_v2")
    return QuantizationConfig(QuantMethod.GPTQ, bits=bits, group_size=group_size,
                              zero_offset=1 if checkpoint_format == "gptq" else 0)
