"""Llama 3.1+ GGUF files keep their rope scaling as one divisor per rotary frequency
(`rope_freqs.weight`). HF Llamas with llama3 rope scaling are written the way llama.cpp's
converter writes them (the divisors computed here from the HF parameters, independently of
engine.gguf_rope), converted back, and compared with HF transformers: the rotary inverse
frequencies and greedy tokens."""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, LlamaConfig

from engine.checkpoints.gguf_checkpoint import GGUFCheckpoint
from engine.models.config import ModelConfig, ModelConfigError
from engine.models.rope import inverse_frequencies
from tests.engine.checkpoints.gguf_files import byte_tokens, write_gguf
from tests.engine.models.helpers import PagedDriver, Sequence, hf_greedy, make_runner

# (head_dim, theta, llama3 parameters): Llama 3.1's and 3.2's (several frequencies between the
# edges), and two where one or no frequency falls between them.
_CASES = {
    "llama3.1": (64, 500000.0, {"factor": 8.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "llama3.2": (64, 500000.0, {"factor": 32.0, "low_freq_factor": 1.0,
                                "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}),
    "one-between": (16, 10000.0, {"factor": 4.0, "low_freq_factor": 1.0,
                                  "high_freq_factor": 4.0,
                                  "original_max_position_embeddings": 1024}),
    "none-between": (16, 10000.0, {"factor": 2.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 1.5,
                                   "original_max_position_embeddings": 1000}),
}  # fmt: skip


def _llama_cpp_rope_freqs(head_dim: int, theta: float, rope: dict[str, Any]) -> np.ndarray:
    """The divisors llama.cpp's convert_hf_to_gguf stores for llama3 rope scaling."""
    freqs = 1.0 / (theta ** (np.arange(0, head_dim, 2, dtype=np.float64) / head_dim))
    old = rope["original_max_position_embeddings"]
    low, high, factor = rope["low_freq_factor"], rope["high_freq_factor"], rope["factor"]
    divisors = []
    for freq in freqs:
        wavelength = 2 * math.pi / freq
        if wavelength < old / high:
            divisors.append(1.0)
        elif wavelength > old / low:
            divisors.append(factor)
        else:
            smooth = (old / wavelength - low) / (high - low)
            divisors.append(1 / ((1 - smooth) / factor + smooth))
    return np.array(divisors, dtype=np.float32)


def _hf_llama(head_dim: int, theta: float, rope: dict[str, Any]) -> Any:
    config = LlamaConfig(
        vocab_size=256, hidden_size=4 * head_dim, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=4, num_key_value_heads=2, head_dim=head_dim,
        max_position_embeddings=512, rope_theta=theta,
        rope_scaling={"rope_type": "llama3", **rope},
    )  # fmt: skip
    torch.manual_seed(0)
    return AutoModelForCausalLM.from_config(config).eval()


def _write(path: Path, hf: Any, theta: float, divisors: np.ndarray) -> Path:
    config = hf.config.to_dict()
    config.pop("rope_scaling", None)  # the file carries the divisors only
    config.pop("rope_parameters", None)
    config["rope_theta"] = theta
    write_gguf(path, "llama", config, dict(hf.state_dict()), byte_tokens(),
               extra_tensors={"rope_freqs.weight": divisors})
    return path


@pytest.mark.parametrize("case", sorted(_CASES))
@torch.no_grad()
def test_the_divisors_become_llama3_scaling_that_hf_agrees_with(tmp_path: Path, case: str) -> None:
    head_dim, theta, rope = _CASES[case]
    hf = _hf_llama(head_dim, theta, rope)
    gguf_file = _write(tmp_path / "m.gguf", hf, theta, _llama_cpp_rope_freqs(head_dim, theta, rope))
    out = GGUFCheckpoint.open(gguf_file).convert(tmp_path / "converted")
    raw = json.loads((out / "config.json").read_text())
    assert raw["rope_scaling"]["rope_type"] == "llama3"
    if case.startswith("llama3"):  # enough frequencies between the edges: the parameters back
        assert raw["rope_scaling"]["factor"] == pytest.approx(rope["factor"], rel=1e-6)
        assert raw["rope_scaling"]["high_freq_factor"] == pytest.approx(4.0, rel=1e-4)
        assert raw["rope_scaling"]["original_max_position_embeddings"] == 8192
    ours = inverse_frequencies(ModelConfig.from_dict(raw).rope, head_dim)
    torch.testing.assert_close(ours, hf.model.rotary_emb.inv_freq.float(), rtol=1e-5, atol=0)
    unscaled = inverse_frequencies(ModelConfig.from_dict({**raw, "rope_scaling": None}).rope,
                                   head_dim)
    assert not torch.allclose(ours, unscaled)  # the scaling does change the frequencies
    prompts = [[(7 * i + 3 * j) % 250 + 3 for j in range(n)] for i, n in enumerate([40, 150])]
    seqs = [Sequence(f"r{i}", p, 10) for i, p in enumerate(prompts)]
    PagedDriver(make_runner(out)).run(seqs, token_budget=64)
    for seq, prompt in zip(seqs, prompts, strict=True):
        assert seq.output == hf_greedy(hf, prompt, 10)


def test_divisors_no_llama3_scaling_gives_are_refused(tmp_path: Path) -> None:
    head_dim, theta, rope = _CASES["llama3.1"]
    hf = _hf_llama(head_dim, theta, rope)
    divisors = _llama_cpp_rope_freqs(head_dim, theta, rope)
    divisors[3] = 2.5  # a short wavelength scaled: no llama3 curve does that
    checkpoint = GGUFCheckpoint.open(_write(tmp_path / "m.gguf", hf, theta, divisors))
    with pytest.raises(ModelConfigError, match=r"rope_freqs\.weight"):
        checkpoint.hf_config()


def test_divisors_of_one_mean_no_scaling(tmp_path: Path) -> None:
    head_dim, theta, rope = _CASES["llama3.1"]
    hf = _hf_llama(head_dim, theta, rope)
    checkpoint = GGUFCheckpoint.open(
        _write(tmp_path / "m.gguf", hf, theta, np.ones(head_dim // 2, dtype=np.float32))
    )
    assert "rope_scaling" not in checkpoint.hf_config()
