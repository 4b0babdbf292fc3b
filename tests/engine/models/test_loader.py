"""Checkpoint loading: fused projections, tied embeddings, dtypes, incomplete checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM

from engine.models.config import ModelConfig, ModelConfigError
from engine.models.loader import load_model, random_hf_state_dict, random_model
from tests.engine.models.helpers import make_checkpoint


def test_fused_projections_hold_the_hf_weights(tmp_path: Path) -> None:
    hf = make_checkpoint(tmp_path, "qwen2")
    model = load_model(tmp_path)
    attn, hf_attn = model.layers[1].self_attn, hf.model.layers[1].self_attn
    expected = torch.cat([hf_attn.q_proj.weight, hf_attn.k_proj.weight, hf_attn.v_proj.weight])
    assert torch.equal(attn.qkv_proj.weight, expected)
    expected_bias = torch.cat([hf_attn.q_proj.bias, hf_attn.k_proj.bias, hf_attn.v_proj.bias])
    assert torch.equal(attn.qkv_proj.bias, expected_bias)
    mlp, hf_mlp = model.layers[0].mlp, hf.model.layers[0].mlp
    assert torch.equal(mlp.gate_up_proj.weight,
                       torch.cat([hf_mlp.gate_proj.weight, hf_mlp.up_proj.weight]))


def test_tied_embeddings_share_one_tensor(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "qwen3")
    assert "lm_head.weight" not in load_file(tmp_path / "model.safetensors")
    model = load_model(tmp_path)
    assert model.lm_head.weight is model.embed_tokens.weight


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_dtype_cast_at_load(tmp_path: Path, dtype: torch.dtype) -> None:
    make_checkpoint(tmp_path, "llama")
    model = load_model(tmp_path, dtype=dtype)
    assert {p.dtype for p in model.parameters()} == {dtype}
    assert model.rotary is not None and model.rotary.cos.dtype == dtype


def test_missing_tensor_is_an_error(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "llama")
    tensors = load_file(tmp_path / "model.safetensors")
    del tensors["model.layers.1.self_attn.v_proj.weight"]
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelConfigError, match="lacks 1 tensors"):
        load_model(tmp_path)


def test_wrong_shape_and_unknown_tensor_are_errors(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "llama")
    tensors = load_file(tmp_path / "model.safetensors")
    tensors["model.norm.weight"] = torch.ones(3)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelConfigError, match="shape"):
        load_model(tmp_path)
    tensors["model.norm.weight"] = torch.ones(64)
    tensors["model.layers.0.extra.weight"] = torch.ones(2)
    save_file(tensors, tmp_path / "model.safetensors")
    with pytest.raises(ModelConfigError, match="no place"):
        load_model(tmp_path)


def test_no_weights_is_an_error(tmp_path: Path) -> None:
    make_checkpoint(tmp_path, "llama")
    (tmp_path / "model.safetensors").unlink()
    with pytest.raises(ModelConfigError, match="no model"):
        load_model(tmp_path)


def test_random_weights_load_into_hf_identically(tmp_path: Path) -> None:
    """random_hf_state_dict gives the engine and transformers the same model."""
    make_checkpoint(tmp_path, "llama")
    config = ModelConfig.from_file(tmp_path)
    hf = AutoModelForCausalLM.from_pretrained(tmp_path)
    hf.load_state_dict(random_hf_state_dict(config, seed=5))
    model = random_model(config, seed=5)
    assert torch.equal(model.lm_head.weight, hf.lm_head.weight)
    assert torch.equal(model.layers[1].self_attn.o_proj.weight,
                       hf.model.layers[1].self_attn.o_proj.weight)
    assert not torch.equal(random_model(config, seed=6).lm_head.weight, hf.lm_head.weight)
