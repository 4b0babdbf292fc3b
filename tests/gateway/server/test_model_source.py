"""What --model names: the default model, the demo model, a GGUF file, a checkpoint directory;
`tiergate convert-gguf`."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine.checkpoints.demo_model import write_demo_model
from engine.models.loader import load_model
from gateway.server.model_source import (
    DEFAULT_MODEL_NAME,
    DEMO_MODEL_NAME,
    ModelSourceError,
    resolve_model,
)
from tests.engine.checkpoints.gguf_files import byte_tokens, write_gguf


def _gguf(tmp_path: Path) -> Path:
    config = LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128,
                         num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=2,
                         max_position_embeddings=128).to_dict()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**config))
    path = tmp_path / "tiny.Q8_0.gguf"
    write_gguf(path, "llama", config, dict(model.state_dict()), byte_tokens())
    return path


def test_a_gguf_file_is_converted_once_per_dtype(tmp_path: Path) -> None:
    gguf_file = _gguf(tmp_path)
    cache = tmp_path / "cache"
    first = resolve_model(str(gguf_file), cache, tmp_path / "demo", torch.float32)
    assert first.default_name == "tiny.Q8_0"
    assert first.model_dir.parent == cache / "gguf"
    written = (first.model_dir / "model.safetensors").stat().st_mtime_ns
    again = resolve_model(str(gguf_file), cache, tmp_path / "demo", torch.float32)
    assert again == first
    assert (first.model_dir / "model.safetensors").stat().st_mtime_ns == written
    bf16 = resolve_model(str(gguf_file), cache, tmp_path / "demo", torch.bfloat16)
    assert bf16.model_dir != first.model_dir
    assert {p.dtype for p in load_model(bf16.model_dir).parameters()} == {torch.bfloat16}
    assert not [p for p in (cache / "gguf").iterdir() if p.name.startswith(".")]  # no staging


def test_dtype_auto_keeps_a_gguf_files_weights_in_the_file(tmp_path: Path) -> None:
    """--dtype auto: the cache holds the config and tokenizer, the engine reads the file."""
    gguf_file = _gguf(tmp_path)
    source = resolve_model(str(gguf_file), tmp_path / "cache", tmp_path / "demo", None)
    assert source.gguf_file == gguf_file and source.model_dir.name.endswith("-stored")
    assert (source.model_dir / "config.json").is_file()
    assert (source.model_dir / "tokenizer.json").is_file()
    assert not list(source.model_dir.glob("*.safetensors*"))
    floats = resolve_model(str(gguf_file), tmp_path / "cache", tmp_path / "demo", torch.float32)
    assert floats.gguf_file is None and floats.model_dir != source.model_dir


def test_demo_directory_and_bad_values(tmp_path: Path) -> None:
    demo = resolve_model("demo", tmp_path / "cache", tmp_path / "demo", torch.float32)
    assert demo == type(demo)(tmp_path / "demo", DEMO_MODEL_NAME)
    assert (tmp_path / "demo" / "config.json").is_file()
    checkpoint = write_demo_model(tmp_path / "my-model")
    mine = resolve_model(str(checkpoint), tmp_path / "cache", tmp_path / "demo", torch.float32)
    assert (mine.model_dir, mine.default_name) == (checkpoint, "my-model")
    for bad in (str(tmp_path / "missing"), str(tmp_path / "demo" / "config.json")):
        with pytest.raises(ModelSourceError, match=r"not a checkpoint directory, a \.gguf file"):
            resolve_model(bad, tmp_path / "cache", tmp_path / "demo", torch.float32)


def test_the_default_model_comes_from_its_package(tmp_path: Path) -> None:
    source = resolve_model(None, tmp_path / "cache", tmp_path / "demo", torch.float32)
    assert source.default_name == DEFAULT_MODEL_NAME
    config = json.loads((source.model_dir / "config.json").read_text())
    assert (config["num_hidden_layers"], config["hidden_size"], config["vocab_size"]) == (
        30, 576, 49152
    )
    assert not (tmp_path / "cache" / "packages").exists()  # found installed, not fetched


def test_convert_gguf_command(tmp_path: Path) -> None:
    gguf_file = _gguf(tmp_path)
    out = tmp_path / "out"
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "convert-gguf", str(gguf_file), str(out),
         "--dtype", "bfloat16", "--json"],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 0, result.stderr
    printed = json.loads(result.stdout)
    assert printed["dtype"] == "bfloat16"
    assert set(printed["files"]) >= {"config.json", "model.safetensors", "tokenizer.json"}
    assert {p.dtype for p in load_model(out).parameters()} == {torch.bfloat16}
    junk = tmp_path / "junk.gguf"
    junk.write_bytes(b"GGUF but not really")
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "convert-gguf", str(junk), str(tmp_path / "x")],
        capture_output=True, text=True, check=False,
    )
    assert result.returncode == 1
    assert "convert-gguf: cannot read GGUF file" in result.stderr


def test_serve_names_a_bad_model_without_a_traceback(tmp_path: Path) -> None:
    result = subprocess.run(
        [sys.executable, "-m", "gateway.cli", "serve", "--port", "0",
         "--model", str(tmp_path / "missing"), "--database-url", f"sqlite:///{tmp_path / 'db'}",
         "--data-dir", str(tmp_path / "data")],
        capture_output=True, text=True, check=False, timeout=120,
    )
    assert result.returncode == 1
    output = result.stdout + result.stderr
    assert "no model could be loaded: --model " in output
    assert "not a checkpoint directory, a .gguf file, 'demo' or 'default'" in output
    assert "Traceback" not in output
