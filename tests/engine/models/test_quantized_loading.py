"""AWQ, GPTQ and fp8 checkpoints (tests.engine.models.quantized_checkpoints) load with their
projections as stored: the model decodes what the same weights dequantized to float32 decode,
on the torch path and in the Triton kernels (under the interpreter without CUDA), no float
copy of a quantized matrix is ever handed to load_weights or left in the model, and configs
the engine cannot serve are refused by name."""

from __future__ import annotations

import json
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import torch

if not torch.cuda.is_available():
    # Must happen before triton decorates the kernels: @triton.jit reads it at import time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from safetensors.torch import load_file, save_file

from engine.config import CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig
from engine.models.config import ModelConfig, ModelConfigError, QuantizationConfigError
from engine.models.decoder import CausalLM
from engine.models.loader import load_model, model_from_tensors
from engine.models.quantized import QuantizedLinear
from engine.models.quantized import loading as quantized_loading
from engine.worker.model_runner import TorchModelRunner
from tests.engine.models.helpers import (
    BLOCK_SIZE,
    HF_CONFIGS,
    PagedDriver,
    RecordingSampler,
    Sequence,
    random_prompts,
)
from tests.engine.models.quantized_checkpoints import (
    QuantizedCheckpoint,
    quantization_config,
    write_quantized_checkpoint,
)

# (id, variant, method, options): every format, over architectures with biases, q/k norms
# and tied embeddings.
CASES: list[tuple[str, str, str, dict[str, Any]]] = [
    ("awq-g32", "llama_bias", "awq", {"group_size": 32}),
    ("gptq4-g32-sym-v1", "qwen3", "gptq", {"bits": 4, "group_size": 32, "symmetric": True}),
    ("gptq8-g64-v2", "qwen2", "gptq", {"bits": 8, "group_size": 64, "v1": False}),
    ("fp8-channel", "llama_bias", "fp8", {"per_channel": True}),
    ("fp8-tensor", "qwen3", "fp8", {"per_channel": False}),
]
NAMES = {"awq-g32": "awq-int4-g32", "gptq4-g32-sym-v1": "gptq-int4-g32",
         "gptq8-g64-v2": "gptq-int8-g64", "fp8-channel": "fp8-e4m3", "fp8-tensor": "fp8-e4m3"}


@pytest.fixture(scope="module", params=CASES, ids=[case[0] for case in CASES])
def checkpoint(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory,
               ) -> tuple[str, QuantizedCheckpoint]:
    case_id, variant, method, options = request.param
    path = tmp_path_factory.mktemp(case_id)
    return case_id, write_quantized_checkpoint(path, variant, method, **options)


def _runner(model: CausalLM, sampler: RecordingSampler) -> TorchModelRunner:
    config = EngineConfig(SchedulerConfig(max_model_len=256), CacheConfig(block_size=BLOCK_SIZE),
                          runner=RunnerConfig(num_kv_blocks=32))
    return TorchModelRunner(model, config, sampler=sampler)


def _logits(model: CausalLM, num_tokens: int, token_budget: int = 16,
            ) -> dict[str, list[torch.Tensor]]:
    """Every sampled row's logits of greedy runs of two prompts (by default a prefill over two
    token budgets, then decodes)."""
    sampler = RecordingSampler(model.config.vocab_size)
    prompts = random_prompts([5, 23], seed=3)
    PagedDriver(_runner(model, sampler)).run(
        [Sequence(f"r{i}", p, num_tokens) for i, p in enumerate(prompts)], token_budget)
    return sampler.logits


def _assert_same_logits(got: dict[str, list[torch.Tensor]],
                        expected: dict[str, list[torch.Tensor]], tolerance: float) -> None:
    assert sorted(got) == sorted(expected)
    for request, rows in expected.items():
        assert len(got[request]) == len(rows)
        for want, have in zip(rows, got[request], strict=True):
            assert float((have - want).norm() / want.norm()) < tolerance, request


def _quantized_linears(model: CausalLM) -> list[QuantizedLinear]:
    return [m for m in model.modules() if isinstance(m, QuantizedLinear)]


def test_loads_as_stored_and_decodes_like_the_dequantized_weights(
        checkpoint: tuple[str, QuantizedCheckpoint], monkeypatch: pytest.MonkeyPatch) -> None:
    case_id, ckpt = checkpoint
    given: list[tuple[str, torch.dtype, tuple[int, ...]]] = []
    load_weights = quantized_loading.load_weights

    def recording(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
        def seen() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in tensors:
                given.append((name, tensor.dtype, tuple(tensor.shape)))
                yield name, tensor
        load_weights(model, seen())

    monkeypatch.setattr(quantized_loading, "load_weights", recording)
    model = load_model(ckpt.path)
    linears = _quantized_linears(model)
    assert len(linears) == 4 * ckpt.config.num_layers  # qkv, o, gate_up, down per layer
    # no float copy of a quantized matrix: not handed to load_weights, not in the model
    projections = {name for name in ckpt.dequantized if name.endswith("_proj.weight")}
    assert not [name for name, _, _ in given if name in projections or "qweight" in name]
    matrix_shapes = {(m.out_features, m.in_features) for m in linears}
    floats = (torch.float32, torch.float16, torch.bfloat16)
    assert not [name for name, tensor in [*model.named_parameters(), *model.named_buffers()]
                if tuple(tensor.shape) in matrix_shapes and tensor.dtype in floats
                and "_proj" in name]
    expected_model = model_from_tensors(ckpt.config, ckpt.dequantized.items(), torch.float32,
                                        "cpu", 512)
    expected = _logits(expected_model, 6)
    sampler = RecordingSampler(model.config.vocab_size)
    runner = _runner(model, sampler)
    assert runner.weight_format == f"float32; stored: {NAMES[case_id]} x8"
    assert runner.decode_forward is None  # the C++ decode forward reads no QuantizedLinear
    # the torch path multiplies by the same float32 matrices: only the summation order differs
    _assert_same_logits(_logits(model, 6), expected, 1e-5)
    for linear in linears:
        linear.use_triton = True
    # the kernels sum the scaled group products in another order (float32 throughout); one
    # prefill step and one decode step (the interpreter is slow)
    _assert_same_logits(_logits(model, 2, token_budget=32),
                        {r: rows[:2] for r, rows in expected.items()}, 1e-4)


def test_half_precision_model_keeps_stored_dtypes(checkpoint: tuple[str, QuantizedCheckpoint],
                                                  ) -> None:
    _, ckpt = checkpoint
    model = load_model(ckpt.path, dtype=torch.bfloat16)
    assert model.norm.weight.dtype == torch.bfloat16
    for linear in _quantized_linears(model):
        assert linear.bias is None or linear.bias.dtype == torch.bfloat16
        assert linear.scales.dtype == (torch.float32 if linear.zeros is None else torch.float16)
        assert linear.qweight.dtype in (torch.int32, torch.float8_e4m3fn)


def _config(quantization: dict[str, Any]) -> dict[str, Any]:
    raw: dict[str, Any] = HF_CONFIGS["llama"]().to_dict()
    return raw | {"quantization_config": quantization}


@pytest.mark.parametrize(("quantization", "named"), [
    ({"quant_method": "bitsandbytes"}, "quant_method 'bitsandbytes'"),
    (quantization_config("awq", group_size=256), "group_size=256"),
    (quantization_config("awq", version="gemv"), "version='gemv'"),
    (quantization_config("awq", zero_point=False), "zero_point=False"),
    (quantization_config("awq") | {"bits": 8}, "bits=8"),
    (quantization_config("gptq", bits=3), "bits=3"),
    (quantization_config("gptq", group_size=-1), "group_size=-1"),
    (quantization_config("gptq", desc_act=True), "desc_act=True"),
    (quantization_config("gptq", checkpoint_format="marlin"), "checkpoint_format='marlin'"),
    (quantization_config("fp8", activation_scheme="static"), "activation_scheme='static'"),
    (quantization_config("fp8", weight_block_size=[128, 128]), "weight_block_size"),
])
def test_unsupported_configs_are_refused_by_name(quantization: dict[str, Any],
                                                 named: str) -> None:
    with pytest.raises(QuantizationConfigError, match=named) as info:
        ModelConfig.from_dict(_config(quantization))
    assert isinstance(info.value, ValueError) and isinstance(info.value, ModelConfigError)


def test_partly_quantized_fused_projection_is_refused(tmp_path: Path) -> None:
    write_quantized_checkpoint(tmp_path, "llama", "awq")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    prefix = "model.layers.0.self_attn.k_proj."
    for part in ("qweight", "qzeros", "scales"):
        file = tmp_path / index["weight_map"][prefix + part]
        tensors = load_file(file)
        del tensors[prefix + part]
        save_file(tensors, file)
    with pytest.raises(ModelConfigError, match="only some of its projections"):
        load_model(tmp_path)


def test_missing_quantized_tensor_is_an_error(tmp_path: Path) -> None:
    write_quantized_checkpoint(tmp_path, "llama", "gptq")
    index = json.loads((tmp_path / "model.safetensors.index.json").read_text())
    name = "model.layers.1.mlp.down_proj.scales"
    file = tmp_path / index["weight_map"][name]
    tensors = load_file(file)
    del tensors[name]
    save_file(tensors, file)
    with pytest.raises(ModelConfigError, match="lacks quantized tensors"):
        load_model(tmp_path)
