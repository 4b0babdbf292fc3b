"""An adapter is read only when it fits its base model and the engine's limits; every refusal
names the problem."""

from __future__ import annotations

import json
import math
import pickle
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file, save_file

from engine.checkpoints.lora_adapter import (
    ADAPTER_CONFIG,
    ADAPTER_WEIGHTS,
    AdapterError,
    read_lora_adapter,
)
from engine.models.config import ModelConfig
from tests.engine.models.helpers import make_checkpoint
from tests.engine.models.lora_adapters import make_adapter

KEY = "base_model.model.model.layers.0.self_attn.q_proj.lora_A.weight"


@pytest.fixture(scope="module")
def base(tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, ModelConfig]:
    path = tmp_path_factory.mktemp("base")
    make_checkpoint(path, "llama", seed=3)
    return path, ModelConfig.from_dict(json.loads((path / "config.json").read_text()))


@pytest.fixture(scope="module")
def good(base: tuple[Path, ModelConfig], tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("adapter") / "a"
    make_adapter(base[0], path, 8, seed=1, targets=("q_proj", "v_proj", "down_proj"),
                 rank_pattern={"down_proj": 4}, alpha_pattern={"v_proj": 32})
    return path


def _copy(good: Path, tmp_path: Path) -> Path:
    target = tmp_path / "copy"
    target.mkdir()
    for name in (ADAPTER_CONFIG, ADAPTER_WEIGHTS):
        (target / name).write_bytes((good / name).read_bytes())
    return target


def test_reads_targets_ranks_and_scaling(base: tuple[Path, ModelConfig], good: Path) -> None:
    _, config = base
    adapter = read_lora_adapter(good, config, max_rank=64)
    assert adapter.targets == ("q_proj", "v_proj", "down_proj")
    assert adapter.rank == 8
    tensors = load_file(str(good / ADAPTER_WEIGHTS))
    layer = adapter.layers[1]
    assert layer["down_proj"].a.shape == (4, config.intermediate_size)
    prefix = "base_model.model.model.layers.1."
    for module, block, alpha, rank in (("q_proj", "self_attn", 16, 8),
                                       ("v_proj", "self_attn", 32, 8),
                                       ("down_proj", "mlp", 16, 4)):
        b = tensors[f"{prefix}{block}.{module}.lora_B.weight"]
        assert torch.allclose(layer[module].b, b * (alpha / rank))


def test_rslora_scaling(base: tuple[Path, ModelConfig], tmp_path: Path) -> None:
    path, config = base
    make_adapter(path, tmp_path / "rs", 16, seed=2, use_rslora=True, alpha=8)
    adapter = read_lora_adapter(tmp_path / "rs", config, max_rank=64)
    tensors = load_file(str(tmp_path / "rs" / ADAPTER_WEIGHTS))
    b = tensors["base_model.model.model.layers.0.mlp.up_proj.lora_B.weight"]
    assert torch.allclose(adapter.layers[0]["up_proj"].b, b * (8 / math.sqrt(16)))


def _rewrite_config(path: Path, **changes: object) -> None:
    config = json.loads((path / ADAPTER_CONFIG).read_text())
    config.update(changes)
    (path / ADAPTER_CONFIG).write_text(json.dumps(config))


def _rewrite_tensors(path: Path, change: dict[str, torch.Tensor | None]) -> None:
    tensors = load_file(str(path / ADAPTER_WEIGHTS))
    for key, value in change.items():
        if value is None:
            del tensors[key]
        else:
            tensors[key] = value
    save_file(tensors, str(path / ADAPTER_WEIGHTS))


REFUSALS = {
    "pickle": ("is a pickle", lambda p: (
        (p / ADAPTER_WEIGHTS).unlink(),
        (p / "adapter_model.bin").write_bytes(pickle.dumps({KEY: [1.0]})))),
    "no weights file": ("adapter_model.safetensors is missing",
                        lambda p: (p / ADAPTER_WEIGHTS).unlink()),
    "no config": ("adapter_config.json is missing", lambda p: (p / ADAPTER_CONFIG).unlink()),
    "config not JSON": ("not readable JSON", lambda p: (p / ADAPTER_CONFIG).write_text("{")),
    "weights not safetensors": ("not a valid safetensors file",
                                lambda p: (p / ADAPTER_WEIGHTS).write_bytes(b"\x00" * 64)),
    "DoRA": ("DoRA", lambda p: _rewrite_config(p, use_dora=True)),
    "prompt tuning": ("peft_type 'PROMPT_TUNING'",
                      lambda p: _rewrite_config(p, peft_type="PROMPT_TUNING")),
    "trained bias": ("train biases", lambda p: _rewrite_config(p, bias="all")),
    "modules saved whole": ("modules_to_save",
                            lambda p: _rewrite_config(p, modules_to_save=["lm_head"])),
    "unsupported target": ("target modules ['embed_tokens']",
                           lambda p: _rewrite_config(p, target_modules=["q_proj",
                                                                        "embed_tokens"])),
    "other tensor": ("is not the A or B of a supported projection", lambda p: _rewrite_tensors(
        p, {"base_model.model.lm_head.lora_A.weight": torch.zeros(8, 64)})),
    "half a pair": ("lora_A and lora_B must both be present",
                    lambda p: _rewrite_tensors(p, {KEY: None})),
    "another base model": ("is the adapter for another base model", lambda p: _rewrite_tensors(
        p, {KEY: torch.zeros(8, 96)})),
    "missing layer": ("the base model has 2 layers", lambda p: _rewrite_tensors(p, {
        KEY.replace("layers.0", "layers.7"): torch.zeros(8, 64),
        KEY.replace("layers.0", "layers.7").replace("lora_A", "lora_B"): torch.zeros(64, 8)})),
    "NaN": ("NaN or infinity", lambda p: _rewrite_tensors(
        p, {KEY: torch.full((8, 64), float("nan"))})),
    "rank unlike its config": ("not the configured rank", lambda p: _rewrite_config(p, r=4)),
}


@pytest.mark.parametrize("case", sorted(REFUSALS))
def test_refusals_name_the_problem(base: tuple[Path, ModelConfig], good: Path, tmp_path: Path,
                                   case: str) -> None:
    _, config = base
    path = _copy(good, tmp_path)
    message, damage = REFUSALS[case]
    damage(path)
    with pytest.raises(AdapterError, match=message.replace("[", r"\[").replace("]", r"\]")):
        read_lora_adapter(path, config, max_rank=64)


def test_rank_and_size_limits(base: tuple[Path, ModelConfig], good: Path) -> None:
    _, config = base
    with pytest.raises(AdapterError, match="rank 8 is above the limit of 4"):
        read_lora_adapter(good, config, max_rank=4)
    with pytest.raises(AdapterError, match="over the limit of 1000"):
        read_lora_adapter(good, config, max_rank=64, max_bytes=1000)


def test_float16_weights_read_as_float32(base: tuple[Path, ModelConfig], good: Path,
                                         tmp_path: Path) -> None:
    _, config = base
    path = _copy(good, tmp_path)
    tensors = {k: v.half() for k, v in load_file(str(path / ADAPTER_WEIGHTS)).items()}
    save_file(tensors, str(path / ADAPTER_WEIGHTS))
    adapter = read_lora_adapter(path, config, max_rank=64)
    assert adapter.layers[0]["q_proj"].a.dtype == torch.float32

