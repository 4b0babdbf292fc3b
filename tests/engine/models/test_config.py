"""Parsing HF config.json files into ModelConfig, per architecture."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from engine.models.config import ModelConfig, ModelConfigError
from tests.engine.models.helpers import HF_CONFIGS


def _raw(variant: str, **extra: Any) -> dict[str, Any]:
    config = HF_CONFIGS[variant]()
    return config.to_dict() | {"architectures": [type(config).__name__.replace(
        "Config", "ForCausalLM")]} | extra


def test_llama_shapes_and_defaults() -> None:
    config = ModelConfig.from_dict(_raw("llama"))
    assert (config.architecture, config.num_heads, config.num_kv_heads, config.head_dim) == (
        "LlamaForCausalLM", 4, 2, 16)
    assert not (config.has_qkv_bias or config.has_o_bias or config.has_qk_norm)
    assert config.sliding_windows == (None, None)
    assert config.dtype == torch.float32


def test_architecture_flags() -> None:
    qwen2 = ModelConfig.from_dict(_raw("qwen2"))
    assert qwen2.has_qkv_bias and not qwen2.has_o_bias
    assert qwen2.sliding_windows == (None, 12)  # layers from max_window_layers=1 slide
    qwen3 = ModelConfig.from_dict(_raw("qwen3"))
    assert qwen3.has_qk_norm and qwen3.tie_word_embeddings and qwen3.head_dim == 32
    mistral = ModelConfig.from_dict(_raw("mistral"))
    assert mistral.sliding_windows == (20, 20)
    llama_bias = ModelConfig.from_dict(_raw("llama_bias"))
    assert llama_bias.has_qkv_bias and llama_bias.has_o_bias and llama_bias.has_mlp_bias


def test_qwen_window_is_off_unless_switched_on() -> None:
    raw = _raw("qwen2", use_sliding_window=False, layer_types=None)
    assert ModelConfig.from_dict(raw).sliding_windows == (None, None)
    mistral = _raw("mistral", sliding_window=None)
    assert ModelConfig.from_dict(mistral).sliding_windows == (None, None)


def test_transformers4_rope_fields() -> None:
    raw = _raw("llama")
    del raw["rope_parameters"]
    raw |= {"rope_theta": 500000.0, "torch_dtype": "bfloat16",
            "rope_scaling": {"rope_type": "llama3", "factor": 32.0, "low_freq_factor": 1.0,
                             "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}}
    config = ModelConfig.from_dict(raw)
    assert config.rope.theta == 500000.0 and config.rope.scaling_type == "llama3"
    assert config.rope.factor == 32.0 and config.rope.original_max_position_embeddings == 8192
    assert config.dtype == torch.bfloat16


def test_model_type_fallback_and_errors() -> None:
    raw = _raw("llama", architectures=None)
    assert ModelConfig.from_dict(raw).architecture == "LlamaForCausalLM"
    with pytest.raises(ModelConfigError, match="unsupported model"):
        ModelConfig.from_dict(_raw("llama", architectures=["GPT2LMHeadModel"], model_type="gpt2"))
    with pytest.raises(ModelConfigError, match="hidden_act"):
        ModelConfig.from_dict(_raw("llama", hidden_act="gelu"))
    with pytest.raises(ModelConfigError, match="rope scaling"):
        ModelConfig.from_dict(_raw("llama", rope_parameters={"rope_type": "yarn", "factor": 2.0}))
    with pytest.raises(ModelConfigError, match="bad model config"):
        ModelConfig.from_dict({"architectures": ["LlamaForCausalLM"]})
