"""The RoPE table matches HF's rotary embeddings for every supported scaling type."""

from __future__ import annotations

from typing import Any

import pytest
import torch
from transformers import LlamaConfig
from transformers.models.llama.modeling_llama import LlamaRotaryEmbedding, apply_rotary_pos_emb

from engine.models.config import ModelConfig
from engine.models.rope import RotaryTable, apply_rope

MAX_POS = 256
SCALINGS: dict[str, dict[str, Any]] = {
    "default": {"rope_type": "default", "rope_theta": 10000.0},
    "linear": {"rope_type": "linear", "rope_theta": 10000.0, "factor": 4.0},
    "dynamic": {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    "llama3": {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0,
               "low_freq_factor": 1.0, "high_freq_factor": 4.0,
               "original_max_position_embeddings": 64},
}


def _configs(scaling: dict[str, Any]) -> tuple[LlamaConfig, ModelConfig]:
    hf = LlamaConfig(hidden_size=128, num_attention_heads=2, num_key_value_heads=1,
                     intermediate_size=64, num_hidden_layers=1, vocab_size=16,
                     max_position_embeddings=MAX_POS, rope_parameters=dict(scaling))
    return hf, ModelConfig.from_dict(hf.to_dict() | {"architectures": ["LlamaForCausalLM"]})


@pytest.mark.parametrize("name", sorted(SCALINGS))
def test_table_matches_hf(name: str) -> None:
    hf_config, config = _configs(SCALINGS[name])
    assert config.rope.scaling_type == name
    table = RotaryTable(config.rope, config.head_dim, 2 * MAX_POS, MAX_POS, torch.float32,
                        torch.device("cpu"))
    x = torch.zeros(1, 1, 1, config.head_dim)
    # One position per call: HF's dynamic scaling depends on the longest position it is given.
    # Beyond MAX_POS (dynamic only) the pow differs from HF's by an ulp: atol 1e-5.
    for position in [0, 1, 17, MAX_POS - 1, MAX_POS, MAX_POS + 37, 2 * MAX_POS - 1]:
        if name != "dynamic" and position >= MAX_POS:
            continue
        cos, sin = LlamaRotaryEmbedding(hf_config)(x, torch.tensor([[position]]))
        half = config.head_dim // 2
        torch.testing.assert_close(table.cos[position], cos[0, 0], rtol=0, atol=1e-5)
        torch.testing.assert_close(table.sin[position, half:], sin[0, 0, half:], rtol=0, atol=1e-5)
        torch.testing.assert_close(table.sin[position, :half], -sin[0, 0, :half], rtol=0,
                                   atol=1e-5)


def test_apply_rope_matches_rotate_half() -> None:
    hf_config, config = _configs(SCALINGS["default"])
    table = RotaryTable(config.rope, config.head_dim, MAX_POS, MAX_POS, torch.float32,
                        torch.device("cpu"))
    positions = torch.tensor([0, 5, 9, 200])
    q = torch.randn(4, 3, config.head_dim)  # [T, N, D]
    cos, sin = LlamaRotaryEmbedding(hf_config)(q, positions[None, :])  # [1, T, D]
    expected, _ = apply_rotary_pos_emb(q.transpose(0, 1)[None], q.transpose(0, 1)[None], cos, sin)
    got = apply_rope(q, *table.lookup(positions))
    torch.testing.assert_close(got, expected[0].transpose(0, 1), rtol=0, atol=1e-5)
