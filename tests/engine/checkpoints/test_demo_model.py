"""The demo checkpoint: deterministic, loadable by transformers offline. Its chat template
renders in the gateway: tests/gateway/openai/test_chat_template.py."""

from __future__ import annotations

import hashlib
import json
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from engine.checkpoints.demo_model import write_demo_model
from gateway.cli import main

FILES = [
    "config.json",
    "generation_config.json",
    "model.safetensors",
    "tokenizer.json",
    "tokenizer_config.json",
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo"), seed=0)


def digests(path: Path) -> dict[str, str]:
    return {name: hashlib.sha256((path / name).read_bytes()).hexdigest() for name in FILES}


def test_writes_the_files_of_a_llama_repository(model_dir: Path) -> None:
    assert sorted(p.name for p in model_dir.iterdir()) == FILES
    config = json.loads((model_dir / "config.json").read_text())
    assert config["model_type"] == "llama"
    assert 2000 <= config["vocab_size"] <= 4096
    assert config["max_position_embeddings"] == 4096
    assert (model_dir / "model.safetensors").stat().st_size < 32 * 2**20


def test_same_seed_same_bytes_other_seed_other_weights(
    model_dir: Path, tmp_path: Path
) -> None:
    again = digests(write_demo_model(tmp_path / "again", seed=0))
    other = digests(write_demo_model(tmp_path / "other", seed=1))
    assert again == digests(model_dir)
    assert other["model.safetensors"] != again["model.safetensors"]
    assert {k: v for k, v in other.items() if k != "model.safetensors"} == {
        k: v for k, v in again.items() if k != "model.safetensors"
    }


def test_transformers_loads_and_runs_it_offline(model_dir: Path) -> None:
    model: Any = AutoModelForCausalLM.from_pretrained(str(model_dir), local_files_only=True)
    hf_tokenizer = AutoTokenizer.from_pretrained(str(model_dir), local_files_only=True)
    ids = hf_tokenizer("Hello, the model reads tokens.", return_tensors="pt").input_ids
    assert ids[0, 0].item() == hf_tokenizer.bos_token_id
    with torch.no_grad():
        logits = model(ids).logits
    assert logits.shape == (1, ids.shape[1], model.config.vocab_size)
    assert torch.isfinite(logits).all()
    generated = model.generate(ids, max_new_tokens=4, do_sample=False)
    assert generated.shape[1] == ids.shape[1] + 4


def test_cli_writes_the_model(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["demo-model", str(tmp_path / "cli"), "--seed", "3", "--json"]) == 0
    report = json.loads(capsys.readouterr().out)
    assert report["seed"] == 3 and report["files"] == FILES
    assert digests(tmp_path / "cli") != {}
