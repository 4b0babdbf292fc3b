"""GGUF checkpoints: names, llama.cpp's q/k permutation, every tensor type against gguf's own
dequantization, the tokenizer, and clear errors for what is not supported."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from gguf import GGMLQuantizationType
from gguf.quants import dequantize
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM, LlamaConfig

from engine.checkpoints.demo_model import CHAT_TEMPLATE, build_tokenizer
from engine.checkpoints.gguf_checkpoint import SUPPORTED_TENSOR_TYPES, GGUFCheckpoint
from engine.models.config import ModelConfig, ModelConfigError
from engine.models.loader import load_model
from engine.text.tokenizer import Tokenizer
from tests.engine.checkpoints.gguf_files import (
    TokenizerFields,
    byte_tokens,
    gguf_name,
    llama_cpp_permute,
    write_gguf,
)
from tests.engine.models.helpers import (
    PagedDriver,
    Sequence,
    hf_greedy,
    make_checkpoint,
    make_runner,
    random_prompts,
)
from tests.engine.text.test_tokenizer import TEXTS

_ARCH = {"llama": "llama", "llama_bias": "llama", "qwen2": "qwen2", "qwen3": "qwen3"}


def _hf_to_gguf(tmp_path: Path, variant: str) -> tuple[Any, Path]:
    """A random HF checkpoint of `variant` and the GGUF file llama.cpp would make of it."""
    hf = make_checkpoint(tmp_path / "hf", variant)
    config = json.loads((tmp_path / "hf" / "config.json").read_text())
    gguf_file = tmp_path / f"{variant}.gguf"
    write_gguf(gguf_file, _ARCH[variant], config, dict(hf.state_dict()), byte_tokens())
    return hf, gguf_file


@pytest.mark.parametrize("variant", sorted(_ARCH))
def test_conversion_gives_back_the_hf_tensors_and_config(tmp_path: Path, variant: str) -> None:
    hf, gguf_file = _hf_to_gguf(tmp_path, variant)
    out = GGUFCheckpoint.open(gguf_file).convert(tmp_path / "converted")
    converted = load_file(out / "model.safetensors")
    expected = {
        name: tensor
        for name, tensor in hf.state_dict().items()
        if not (hf.config.tie_word_embeddings and name == "lm_head.weight")
    }
    assert sorted(converted) == sorted(expected)
    for name, tensor in expected.items():
        assert torch.equal(converted[name], tensor), name
    ours, theirs = ModelConfig.from_file(out), ModelConfig.from_file(tmp_path / "hf")
    for name in ("architecture", "vocab_size", "hidden_size", "intermediate_size", "num_layers",
                 "num_heads", "num_kv_heads", "head_dim", "rope", "tie_word_embeddings",
                 "has_qkv_bias", "has_o_bias", "has_mlp_bias", "has_qk_norm"):
        assert getattr(ours, name) == getattr(theirs, name), name


def test_a_converted_llama_decodes_hf_greedy_tokens(tmp_path: Path) -> None:
    """The q/k permutation undone: the converted model's greedy tokens are HF's."""
    hf, gguf_file = _hf_to_gguf(tmp_path, "llama")
    out = GGUFCheckpoint.open(gguf_file).convert(tmp_path / "converted")
    prompts = random_prompts([5, 23, 40], seed=3)
    seqs = [Sequence(f"r{i}", p, 12) for i, p in enumerate(prompts)]
    PagedDriver(make_runner(out)).run(seqs, token_budget=32)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.output == hf_greedy(hf, prompt, 12)


def _quant_test_config() -> dict[str, Any]:
    """Rows of 256 values: what K-quant blocks need."""
    config = LlamaConfig(
        vocab_size=256, hidden_size=256, intermediate_size=256, num_hidden_layers=1,
        num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=128,
    )
    return config.to_dict()


@pytest.mark.parametrize(
    "tensor_type", sorted(SUPPORTED_TENSOR_TYPES, key=lambda t: t.name), ids=lambda t: t.name
)
def test_each_tensor_type_reads_as_gguf_dequantizes_it(
    tmp_path: Path, tensor_type: GGMLQuantizationType
) -> None:
    config = _quant_test_config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**config))
    gguf_file = tmp_path / "model.gguf"
    stored = write_gguf(gguf_file, "llama", config, dict(model.state_dict()), byte_tokens(),
                        tensor_type)
    checkpoint = GGUFCheckpoint.open(gguf_file)
    seen = set()
    for hf_name, tensor in checkpoint.tensors(torch.float32):
        name = gguf_name(hf_name)
        seen.add(name)
        qtype = tensor_type if stored[name].dtype == np.uint8 or tensor.dim() == 2 else None
        reference = (
            dequantize(stored[name], qtype) if qtype not in (None, GGMLQuantizationType.F32)
            else stored[name]
        )
        ours = tensor.numpy()
        if ".attn_q." in name or ".attn_k." in name:
            heads = config["num_attention_heads"] if ".attn_q." in name else 2
            ours = llama_cpp_permute(ours, heads)
        assert ours.shape == reference.shape, name
        assert np.array_equal(ours, reference.astype(np.float32)), name
    assert seen == set(stored)
    # The converted directory loads, in the serving dtype.
    out = checkpoint.convert(tmp_path / "bf16", torch.bfloat16)
    model_bf16 = load_model(out)
    assert {p.dtype for p in model_bf16.parameters()} == {torch.bfloat16}


def _demo_tokenizer_fields() -> tuple[Tokenizer, TokenizerFields]:
    """The demo model's byte-level BPE written as GGUF tokenizer fields."""
    backend = build_tokenizer()
    reference = Tokenizer(backend, {"bos_token": "<|begin_of_text|>",
                                    "eos_token": "<|end_of_text|>"}, CHAT_TEMPLATE)
    state = json.loads(backend.to_str())
    by_id = {i: t for t, i in backend.get_vocab(with_added_tokens=True).items()}
    specials = {t["id"] for t in state["added_tokens"] if t["special"]}
    merges = [m if isinstance(m, str) else " ".join(m) for m in state["model"]["merges"]]
    fields = TokenizerFields(
        tokens=[by_id[i] for i in range(len(by_id))],
        token_types=[3 if i in specials else 1 for i in range(len(by_id))],
        merges=merges,
        pre="gpt-2",
        bos_token_id=backend.token_to_id("<|begin_of_text|>"),
        eos_token_id=backend.token_to_id("<|end_of_text|>"),
        add_bos_token=True,
        chat_template=CHAT_TEMPLATE,
    )
    return reference, fields


def test_the_tokenizer_is_rebuilt_from_the_gguf_fields(tmp_path: Path) -> None:
    reference, fields = _demo_tokenizer_fields()
    config = _quant_test_config()
    config["vocab_size"] = len(fields.tokens)
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**config))
    write_gguf(tmp_path / "m.gguf", "llama", config, dict(model.state_dict()), fields)
    checkpoint = GGUFCheckpoint.open(tmp_path / "m.gguf")
    out = checkpoint.convert(tmp_path / "converted")
    for tokenizer in (checkpoint.tokenizer(), Tokenizer.from_dir(out)):
        for text in TEXTS:
            ids = tokenizer.encode(text)
            assert ids == reference.encode(text), text
            assert ids[0] == fields.bos_token_id  # add_bos_token
            assert tokenizer.decode(ids) == reference.decode(ids)
            assert tokenizer.decode(ids, skip_special_tokens=False) == reference.decode(
                ids, skip_special_tokens=False
            )
        assert tokenizer.eos_token_id == fields.eos_token_id
        # What the gateway renders chat prompts from (gateway.openai.chat_template).
        assert tokenizer.chat_template == reference.chat_template
        assert tokenizer.special_tokens_map == reference.special_tokens_map


def _small_gguf(tmp_path: Path, arch: str = "llama", **tokenizer: Any) -> Path:
    config = _quant_test_config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**config))
    fields = byte_tokens()
    for key, value in tokenizer.items():
        setattr(fields, key, value)
    tmp_path.mkdir(parents=True, exist_ok=True)
    path = tmp_path / "m.gguf"
    write_gguf(path, arch, config, dict(model.state_dict()), fields)
    return path


def test_unsupported_files_are_clear_errors(tmp_path: Path) -> None:
    with pytest.raises(ModelConfigError, match="unsupported GGUF architecture 'gpt2'"):
        GGUFCheckpoint.open(_small_gguf(tmp_path / "a", arch="gpt2"))
    checkpoint = GGUFCheckpoint.open(_small_gguf(tmp_path / "b", pre="no-such-split"))
    with pytest.raises(ModelConfigError, match="unsupported GGUF pre-tokenizer 'no-such-split'"):
        checkpoint.tokenizer()
    with pytest.raises(ModelConfigError, match="cannot read GGUF file"):
        (tmp_path / "junk.gguf").write_bytes(b"not a gguf file at all")
        GGUFCheckpoint.open(tmp_path / "junk.gguf")


def test_an_unsupported_tensor_type_is_named(tmp_path: Path) -> None:
    config = _quant_test_config()
    torch.manual_seed(0)
    model = AutoModelForCausalLM.from_config(LlamaConfig(**config))
    path = tmp_path / "iq.gguf"
    write_gguf(path, "llama", config, dict(model.state_dict()), byte_tokens(),
               GGMLQuantizationType.IQ4_NL)
    with pytest.raises(ModelConfigError, match="unsupported GGUF tensor types IQ4_NL"):
        GGUFCheckpoint.open(path)
