"""GGUF files served as stored (engine.checkpoints.gguf_panels): for every supported
architecture and each block type the kernels read, the model over the file's blocks decodes
what the same file dequantized to float32 decodes, through the runner (prefills on the layer
path, decodes in the C++ decode forward), with no float copy of a stored matrix."""

from __future__ import annotations

import json
from contextlib import nullcontext
from pathlib import Path
from typing import Any

import pytest
import torch
from gguf import GGMLQuantizationType
from transformers import AutoModelForCausalLM, LlamaConfig

from engine import LoraRequest
from engine.checkpoints.gguf_checkpoint import GGUFCheckpoint
from engine.checkpoints.gguf_panels import load_gguf_model, load_stored_model
from engine.config import CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig
from engine.models import cpu_decode
from engine.models.config import ModelConfig
from engine.models.cpu_decode import PanelEmbedding, PanelLinear
from engine.models.decoder import CausalLM
from engine.models.loader import load_model
from engine.worker.model_runner import TorchModelRunner
from tests.engine.checkpoints.gguf_files import byte_tokens, write_gguf
from tests.engine.models.helpers import (
    BLOCK_SIZE,
    PagedDriver,
    RecordingSampler,
    Sequence,
    make_checkpoint,
    random_prompts,
)
from tests.engine.models.int8_rounding import rounded_like
from tests.engine.models.lora_adapters import make_adapter

T = GGMLQuantizationType
_ARCH = {"llama": "llama", "llama_bias": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def _runner(model: CausalLM, sampler: RecordingSampler,
            reference: bool = False) -> TorchModelRunner:
    """reference: every step on the model's torch layers (no C++ decode forward, no oneDNN
    packing), so that hooks on its nn.Linear modules see every product."""
    runner = RunnerConfig(num_kv_blocks=64, pack_cpu_weights=not reference,
                          cpu_decode_rows=0 if reference else RunnerConfig.cpu_decode_rows)
    config = EngineConfig(SchedulerConfig(max_model_len=256), CacheConfig(block_size=BLOCK_SIZE),
                          runner=runner)
    return TorchModelRunner(model, config, sampler=sampler)


def _logits(model: CausalLM, prompts: list[list[int]], loras: list[LoraRequest | None],
            stored: CausalLM | None = None) -> dict[str, list[torch.Tensor]]:
    """Every sampled row's logits of greedy runs of the prompts (12 tokens each), each on its
    adapter or the base model; stored: the model's layers take their inputs as that model's
    products do (int8 activations above int8_activation_rows)."""
    sampler = RecordingSampler(model.config.vocab_size)
    runner = _runner(model, sampler, reference=stored is not None)
    assert (runner.decode_forward is None) == (stored is not None)  # else the C++ forward
    with nullcontext() if stored is None else rounded_like(model, stored):
        PagedDriver(runner).run([Sequence(f"r{i}", p, 12, lora=lora)
                                 for i, (p, lora) in enumerate(zip(prompts, loras, strict=True))],
                                token_budget=32)
    return sampler.logits


def _served_alike(float_model: CausalLM, stored: CausalLM,
                  loras: list[LoraRequest | None] | None = None) -> None:
    prompts = random_prompts([5, 23, 40], seed=3)  # 40: a prefill over two token budgets
    loras = loras or [None] * len(prompts)
    expected = _logits(float_model, prompts, loras, stored)
    got = _logits(stored, prompts, loras)
    # Products of more than int8_activation_rows rows round their activations to int8, and
    # a quantized embedding's rows hold exact ties (k + 1/2 steps) that the kernels' and
    # torch's last bits send either way: one step of one input, then carried through the
    # layers and the steps. Float-only paths agree to 1e-4; the int8 ones here to 7e-3 at most.
    rounds = any(cpu_decode.int8_activation_rows(m.panels.format) is not None
                 for m in stored.modules() if isinstance(m, PanelLinear))
    tolerance = 2e-2 if rounds else 1e-4
    assert sorted(got) == sorted(expected)
    for request, rows in expected.items():
        assert len(got[request]) == len(rows) == 12
        for want, have in zip(rows, got[request], strict=True):
            assert torch.equal(have.argmax(), want.argmax()), request
            assert float((have - want).norm() / want.norm()) < tolerance, request


def _stored_modules(model: CausalLM) -> tuple[int, int]:
    """(PanelLinear modules, PanelEmbedding modules) of the model."""
    modules = list(model.modules())
    return (sum(isinstance(m, PanelLinear) for m in modules),
            sum(isinstance(m, PanelEmbedding) for m in modules))


@pytest.mark.parametrize("tensor_type", [T.Q8_0, T.Q4_0, T.Q4_1], ids=lambda t: t.name)
@pytest.mark.parametrize("variant", sorted(_ARCH))
def test_a_stored_model_decodes_what_the_dequantized_one_does(
    tmp_path: Path, variant: str, tensor_type: GGMLQuantizationType,
) -> None:
    hf = make_checkpoint(tmp_path / "hf", variant)
    config_dict = json.loads((tmp_path / "hf" / "config.json").read_text())
    gguf_file = tmp_path / f"{variant}.gguf"
    write_gguf(gguf_file, _ARCH[variant], config_dict, dict(hf.state_dict()), byte_tokens(),
               tensor_type)
    checkpoint = GGUFCheckpoint.open(gguf_file)
    converted = checkpoint.convert(tmp_path / "converted")
    config = ModelConfig.from_file(converted)
    float_model = load_model(converted, torch.float32, "cpu", 256)
    stored = load_stored_model(checkpoint, config, 256)
    # Every matrix as stored: four products a layer, the lm_head (tied: the embedding's
    # panels); no float weight but norms and biases.
    assert _stored_modules(stored) == (4 * config.num_layers + 1, 1)
    assert all(p.dim() == 1 for p in stored.parameters())
    _served_alike(float_model, stored)


def test_adapters_run_over_stored_matrices(tmp_path: Path) -> None:
    """Two LoRA adapters and the base model in one batch over a stored Q4_1 Llama: the
    adapters' updates (the C++ LoRA kernels, in the decode forward and the layer path) add to
    products over the blocks as they add to float ones."""
    hf = make_checkpoint(tmp_path / "hf", "llama")
    config_dict = json.loads((tmp_path / "hf" / "config.json").read_text())
    gguf_file = tmp_path / "llama.gguf"
    write_gguf(gguf_file, "llama", config_dict, dict(hf.state_dict()), byte_tokens(), T.Q4_1)
    checkpoint = GGUFCheckpoint.open(gguf_file)
    converted = checkpoint.convert(tmp_path / "converted")
    adapters = [make_adapter(tmp_path / "hf", tmp_path / f"a{rank}", rank, seed=rank).lora
                for rank in (8, 16)]
    stored = load_stored_model(checkpoint, ModelConfig.from_file(converted), 256)
    loras: list[LoraRequest | None] = [adapters[0], None, adapters[1]]
    _served_alike(load_model(converted, torch.float32, "cpu", 256), stored, loras)
    prompts = random_prompts([5, 23, 40], seed=3)
    adapted, base = _logits(stored, prompts, loras), _logits(stored, prompts, [None] * 3)
    assert not torch.allclose(adapted["r0"][0], base["r0"][0])  # the adapters apply
    assert torch.allclose(adapted["r1"][0], base["r1"][0])


@pytest.mark.parametrize("tensor_type", [T.Q4_K, T.Q5_K, T.Q6_K], ids=lambda t: t.name)
def test_k_quant_blocks_are_served_as_stored(tmp_path: Path,
                                             tensor_type: GGMLQuantizationType) -> None:
    """K-quants (random blocks: gguf-py has no K-quant quantizer), rows of 256 values."""
    config_dict: dict[str, Any] = LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
        bos_token_id=None, eos_token_id=None, pad_token_id=None).to_dict()
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**config_dict))
    gguf_file = tmp_path / f"model.{tensor_type.name}.gguf"
    write_gguf(gguf_file, "llama", config_dict, dict(hf.state_dict()), byte_tokens(),
               tensor_type)
    checkpoint = GGUFCheckpoint.open(gguf_file)
    converted = checkpoint.convert(tmp_path / "converted")
    config = ModelConfig.from_file(converted)
    stored = load_gguf_model(checkpoint, config, torch.device("cpu"), 256)
    assert _stored_modules(stored) == (4 * config.num_layers + 1, 1)  # untied: own panels
    assert stored.lm_head.panels is not stored.embed_tokens.panels
    sampler = RecordingSampler(config.vocab_size)
    assert _runner(stored, sampler).weight_format == f"float32; stored: {tensor_type.name} x10"
    _served_alike(load_model(converted, torch.float32, "cpu", 256), stored)


def test_types_the_kernels_do_not_read_are_dequantized_at_load(tmp_path: Path) -> None:
    """A file of Q2_K matrices: nothing is stored as panels, every weight is float32."""
    config_dict: dict[str, Any] = LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256).to_dict()
    torch.manual_seed(0)
    hf = AutoModelForCausalLM.from_config(LlamaConfig(**config_dict))
    gguf_file = tmp_path / "model.Q2_K.gguf"
    write_gguf(gguf_file, "llama", config_dict, dict(hf.state_dict()), byte_tokens(), T.Q2_K)
    checkpoint = GGUFCheckpoint.open(gguf_file)
    config = ModelConfig.from_file(checkpoint.convert(tmp_path / "converted", weights=False))
    model = load_gguf_model(checkpoint, config, torch.device("cpu"), 256)
    assert _stored_modules(model) == (0, 0)
    assert isinstance(model.embed_tokens, torch.nn.Embedding)
    assert _runner(model, RecordingSampler(config.vocab_size)).weight_format == "float32"
    assert not (tmp_path / "converted" / "model.safetensors").exists()  # config, tokenizer
