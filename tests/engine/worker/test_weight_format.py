"""The weight format label (engine.worker.weight_format): its grammar, its bounds, the real
runners' labels, and the label carried to the engine's clients (a thread, a process)."""

from __future__ import annotations

import functools
import random
import re
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM, LlamaConfig, PreTrainedModel

from engine import CacheConfig, EngineConfig, LLMEngine, RunnerConfig, SchedulerConfig
from engine.checkpoints.gguf_checkpoint import GGUFCheckpoint
from engine.checkpoints.gguf_panels import load_gguf_model
from engine.models.config import ModelConfig
from engine.process.async_engine import AsyncLLMEngine
from engine.process.engine_process import EngineProcess
from engine.testing.fake_runner import FakeModelRunner
from engine.worker.model_runner import TorchModelRunner
from engine.worker.weight_format import (
    MAX_WEIGHT_FORMAT_LABEL_LENGTH,
    NO_WEIGHTS_LABEL,
    weight_format_label,
)
from tests.engine.checkpoints.gguf_files import byte_tokens, write_gguf
from tests.engine.models.helpers import BLOCK_SIZE

_LABEL = re.compile(r"^[a-z0-9_.+-]+$")


@pytest.mark.parametrize(("description", "label"), [
    ("float32", "float32"),
    ("bfloat16", "bfloat16"),
    ("float16", "float16"),
    ("float32; stored: Q4_1 x120", "gguf-q4_1"),
    # the most common stored type first, whatever order the description lists them in
    ("float32; stored: Q4_1 x120, Q8_0 x1", "gguf-q4_1+q8_0"),
    ("float32; stored: Q8_0 x1, Q4_1 x120", "gguf-q4_1+q8_0"),
    ("float32; stored: Q4_K x3, Q8_0 x3", "gguf-q4_k+q8_0"),  # a tie: by name
    # a matrix stacked from two types (q, k, v into qkv) counts for each
    ("float32; stored: Q4_K x4, Q4_K+Q6_K x2, Q6_K x1", "gguf-q4_k+q6_k"),
    ("float32; stored: Q6_K+Q8_0 x3, Q8_0 x2", "gguf-q8_0+q6_k"),
    ("float32; stored: F16 x2", "gguf-f16"),
    # the CUDA formats (engine.models.config's names): the family and its width, int4 where
    # the kind says no more; not the group size
    ("bfloat16; stored: awq-int4-g128 x96", "awq-int4"),
    ("float16; stored: AWQ x96", "awq-int4"),
    ("bfloat16; stored: gptq-int4-g32 x96", "gptq-int4"),
    ("bfloat16; stored: gptq-int8-g128 x96", "gptq-int8"),
    ("bfloat16; stored: fp8-e4m3 x96", "fp8"),
    ("bfloat16; stored: FP8 x96", "fp8"),
    ("bfloat16; stored: float8_e4m3fn x96", "fp8"),
    ("float8_e4m3fn", "fp8"),
    ("bfloat16; stored: AWQ x90, fp8 x6", "awq-int4+fp8"),
    ("", "unknown"),
])  # fmt: skip
def test_labels(description: str, label: str) -> None:
    assert weight_format_label(description) == label


def test_a_label_too_long_keeps_the_most_common_types() -> None:
    kinds = ["Q4_K", "Q8_0", "Q4_0", "Q4_1", "Q5_K", "Q6_K", "IQ4_XS", "Q5_0"]
    description = "float32; stored: " + ", ".join(
        f"{kind} x{100 - i}" for i, kind in enumerate(kinds))
    label = weight_format_label(description)
    assert label == "gguf-q4_k+q8_0+q4_0+q4_1+more"
    assert len(label) <= MAX_WEIGHT_FORMAT_LABEL_LENGTH


def test_labels_are_short_safe_and_deterministic() -> None:
    rng = random.Random(5)
    kinds = ["Q4_K", "Q8_0", "Q4_0", "Q4_1", "Q4_K+Q8_0", "awq-int4-g128", "GPTQ", "fp8-e4m3",
             "F16", "IQ4_XS", "Q5_K+Q6_K", "odd kind/with: punctuation"]
    for _ in range(500):
        chosen = rng.sample(kinds, rng.randint(0, len(kinds)))
        dtype = rng.choice(["float32", "bfloat16", "float16", "float8_e5m2"])
        entries = [f"{kind} x{rng.randint(1, 300)}" for kind in chosen]
        description = f"{dtype}; stored: {', '.join(entries)}" if entries else dtype
        label = weight_format_label(description)
        assert 0 < len(label) <= MAX_WEIGHT_FORMAT_LABEL_LENGTH, description
        assert _LABEL.match(label), (description, label)
        rng.shuffle(entries)  # the description's order does not change the label
        if entries:
            assert weight_format_label(f"{dtype}; stored: {', '.join(entries)}") == label


# -- the runners ------------------------------------------------------------------------------


def _config(**runner: Any) -> EngineConfig:
    return EngineConfig(SchedulerConfig(max_model_len=256), CacheConfig(block_size=BLOCK_SIZE),
                        runner=RunnerConfig(num_kv_blocks=16, **runner))


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_a_float_runner_is_labelled_by_its_dtype(
    llama: tuple[Path, PreTrainedModel], dtype: torch.dtype
) -> None:
    path, _ = llama
    runner = TorchModelRunner.from_model_dir(path, _config(), dtype=dtype)
    assert runner.weight_format_label == str(dtype).removeprefix("torch.")


def test_a_runner_of_stored_gguf_blocks_is_labelled_by_their_type(tmp_path: Path) -> None:
    config_dict: dict[str, Any] = LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=None, eos_token_id=None, pad_token_id=None).to_dict()
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**config_dict))
    gguf_file = tmp_path / "model.Q4_1.gguf"
    write_gguf(gguf_file, "llama", config_dict, dict(hf.state_dict()), byte_tokens(),
               GGMLQuantizationType.Q4_1)
    checkpoint = GGUFCheckpoint.open(gguf_file)
    config = ModelConfig.from_file(checkpoint.convert(tmp_path / "converted", weights=False))
    runner = TorchModelRunner(load_gguf_model(checkpoint, config, torch.device("cpu"), 256),
                              _config())
    assert "Q4_1" in runner.weight_format
    assert runner.weight_format_label == "gguf-q4_1"


def test_runners_without_weights_say_so() -> None:
    assert FakeModelRunner(_config()).weight_format_label == NO_WEIGHTS_LABEL


# -- to the engine's clients ------------------------------------------------------------------


def bfloat16_engine(model_dir: Path) -> LLMEngine:
    """A real model's engine in bfloat16 (module-level: an engine process builds it)."""
    config = _config()
    return LLMEngine(config, TorchModelRunner.from_model_dir(model_dir, config,
                                                             dtype=torch.bfloat16))


def test_the_engine_clients_carry_the_label(llama: tuple[Path, PreTrainedModel]) -> None:
    path, _ = llama
    in_thread = AsyncLLMEngine(bfloat16_engine(path))
    try:
        assert in_thread.weight_format == "bfloat16"
    finally:
        in_thread.shutdown()
    in_process = EngineProcess(functools.partial(bfloat16_engine, path))
    try:
        assert in_process.weight_format == "bfloat16"  # in the handshake
    finally:
        in_process.shutdown()
