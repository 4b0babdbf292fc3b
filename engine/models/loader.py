"""Build a CausalLM from a HF checkpoint directory (safetensors, single or sharded), or from
seeded random weights in HF naming (benchmarks and tests)."""

from __future__ import annotations

import json
import re
from collections.abc import Iterable, Iterator
from pathlib import Path

import torch
from safetensors import safe_open

from engine.models.config import ModelConfig, ModelConfigError
from engine.models.decoder import CausalLM

__all__ = [
    "checkpoint_dtypes",
    "checkpoint_tensors",
    "fused_target",
    "load_model",
    "load_weights",
    "model_from_tensors",
    "random_hf_state_dict",
    "random_model",
    "shard_slices",
]

# HF projection -> (our fused parameter, shard index inside it).
_FUSED = {
    "q_proj": ("qkv_proj", 0),
    "k_proj": ("qkv_proj", 1),
    "v_proj": ("qkv_proj", 2),
    "gate_proj": ("gate_up_proj", 0),
    "up_proj": ("gate_up_proj", 1),
}
_FUSED_PARENT = re.compile(r"^layers\.\d+\.(?:self_attn|mlp)$")
# Buffers some old checkpoints carry; recomputed here.
_IGNORED = re.compile(r"rotary_emb\.inv_freq$")


def _checkpoint_files(model_dir: Path) -> list[Path]:
    index = model_dir / "model.safetensors.index.json"
    if index.exists():
        weight_map: dict[str, str] = json.loads(index.read_text())["weight_map"]
        return [model_dir / file for file in sorted(set(weight_map.values()))]
    if (model_dir / "model.safetensors").exists():
        return [model_dir / "model.safetensors"]
    raise ModelConfigError(f"no model.safetensors or its index in {model_dir}")


def checkpoint_tensors(model_dir: str | Path) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, tensor) of every tensor in model.safetensors or the shards of its index."""
    for file in _checkpoint_files(Path(model_dir)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                yield name, f.get_tensor(name)


def checkpoint_dtypes(model_dir: str | Path) -> dict[str, str]:
    """The safetensors dtype (e.g. "F16", "I32") of every tensor of checkpoint_tensors, by HF
    name, read from the files' headers only."""
    dtypes: dict[str, str] = {}
    for file in _checkpoint_files(Path(model_dir)):
        with safe_open(str(file), framework="pt", device="cpu") as f:
            for name in f.keys():  # noqa: SIM118 (safe_open is not a dict)
                dtypes[name] = f.get_slice(name).get_dtype()
    return dtypes


def fused_target(module: str) -> tuple[str, int]:
    """Our module of an HF module name (without "model."), and its shard index inside it
    (-1: the whole module), e.g. "layers.0.self_attn.k_proj" -> ("layers.0.self_attn.qkv_proj",
    1)."""
    parent, _, projection = module.rpartition(".")
    if projection in _FUSED and _FUSED_PARENT.match(parent):
        fused, shard = _FUSED[projection]
        return f"{parent}.{fused}", shard
    return module, -1


def shard_slices(config: ModelConfig) -> dict[str, list[slice]]:
    """Row ranges of each shard inside a fused parameter."""
    c = config
    q, kv, inter = c.q_size, c.kv_size, c.intermediate_size
    return {
        "qkv_proj": [slice(0, q), slice(q, q + kv), slice(q + kv, q + 2 * kv)],
        "gate_up_proj": [slice(0, inter), slice(inter, 2 * inter)],
    }


def load_weights(model: CausalLM, tensors: Iterable[tuple[str, torch.Tensor]]) -> None:
    """Copy HF-named tensors into the model (casting to its dtype); every parameter must be set."""
    params = dict(model.named_parameters(remove_duplicate=False))
    slices = shard_slices(model.config)
    loaded: set[tuple[str, int]] = set()  # (parameter name, shard index; -1 for a whole tensor)
    tied = model.config.tie_word_embeddings
    for hf_name, tensor in tensors:
        name = hf_name.removeprefix("model.")
        if _IGNORED.search(name) or (tied and name == "lm_head.weight"):
            continue  # lm_head shares the embedding when tied
        module, _, kind = name.rpartition(".")
        owner, shard = fused_target(module)
        target = f"{owner}.{kind}"
        rows = slice(None) if shard < 0 else slices[owner.rpartition(".")[2]][shard]
        if target not in params:
            raise ModelConfigError(f"checkpoint tensor {hf_name} has no place in the model")
        destination = params[target].data[rows]
        if destination.shape != tensor.shape:
            raise ModelConfigError(
                f"{hf_name}: checkpoint shape {tuple(tensor.shape)}, "
                f"model expects {tuple(destination.shape)}"
            )
        destination.copy_(tensor)
        loaded.add((target, shard))
    _check_complete(params, slices, loaded, tied)


def _check_complete(
    params: dict[str, torch.nn.Parameter],
    slices: dict[str, list[slice]],
    loaded: set[tuple[str, int]],
    tied: bool,
) -> None:
    missing = []
    for name in params:
        if tied and name == "lm_head.weight":
            continue
        fused = name.split(".")[-2]
        shards = range(len(slices[fused])) if fused in slices else [-1]
        missing += [f"{name}[{s}]" for s in shards if (name, s) not in loaded]
    if missing:
        raise ModelConfigError(f"checkpoint lacks {len(missing)} tensors, e.g. {missing[:3]}")


def model_from_tensors(
    config: ModelConfig,
    tensors: Iterable[tuple[str, torch.Tensor]],
    dtype: torch.dtype,
    device: torch.device | str,
    max_model_len: int,
) -> CausalLM:
    """The model of config in dtype on device, every weight from HF-named tensors."""
    model = _empty_model(config, dtype, torch.device(device), max_model_len)
    load_weights(model, tensors)
    model.build_rotary_table()
    return model.eval()


def _empty_model(
    config: ModelConfig, dtype: torch.dtype, device: torch.device, max_model_len: int
) -> CausalLM:
    with torch.device("meta"):
        model = CausalLM(config, max_positions=max_model_len)
    model = model.to_empty(device=device).to(dtype)
    if config.tie_word_embeddings:
        model.lm_head.weight = model.embed_tokens.weight
    return model


def load_model(
    model_dir: str | Path,
    dtype: torch.dtype | None = None,
    device: torch.device | str = "cpu",
    max_model_len: int | None = None,
) -> CausalLM:
    """Read config.json and the safetensors weights of a HF checkpoint directory; the linear
    layers of an AWQ, GPTQ or fp8 checkpoint stay as stored (engine.models.quantized)."""
    config = ModelConfig.from_file(model_dir)
    if config.quantization is not None:
        # imported here: the quantized loader builds on this module's functions
        from engine.models.quantized.loading import load_quantized_model

        return load_quantized_model(model_dir, config, dtype or config.dtype, device,
                                    max_model_len or config.max_position_embeddings)
    return model_from_tensors(config, checkpoint_tensors(model_dir), dtype or config.dtype,
                              device, max_model_len or config.max_position_embeddings)


def random_hf_state_dict(config: ModelConfig, seed: int) -> dict[str, torch.Tensor]:
    """Seeded random float32 weights under HF names (normal(0, 0.02), norms 1, biases 0).

    The same dict loads into this engine (load_weights) and into a transformers model
    (load_state_dict), so benchmarks compare both on identical weights.
    """
    generator = torch.Generator().manual_seed(seed)
    e, inter = config.hidden_size, config.intermediate_size

    def normal(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=generator) * 0.02

    state = {"model.embed_tokens.weight": normal(config.vocab_size, e)}
    for i in range(config.num_layers):
        p = f"model.layers.{i}."
        state[p + "input_layernorm.weight"] = torch.ones(e)
        state[p + "post_attention_layernorm.weight"] = torch.ones(e)
        for proj, rows in (("q", config.q_size), ("k", config.kv_size), ("v", config.kv_size)):
            state[p + f"self_attn.{proj}_proj.weight"] = normal(rows, e)
            if config.has_qkv_bias:
                state[p + f"self_attn.{proj}_proj.bias"] = torch.zeros(rows)
        state[p + "self_attn.o_proj.weight"] = normal(e, config.q_size)
        if config.has_o_bias:
            state[p + "self_attn.o_proj.bias"] = torch.zeros(e)
        if config.has_qk_norm:
            state[p + "self_attn.q_norm.weight"] = torch.ones(config.head_dim)
            state[p + "self_attn.k_norm.weight"] = torch.ones(config.head_dim)
        for proj, (rows, cols) in (("gate", (inter, e)), ("up", (inter, e)), ("down", (e, inter))):
            state[p + f"mlp.{proj}_proj.weight"] = normal(rows, cols)
            if config.has_mlp_bias:
                state[p + f"mlp.{proj}_proj.bias"] = torch.zeros(rows)
    state["model.norm.weight"] = torch.ones(e)
    if not config.tie_word_embeddings:
        state["lm_head.weight"] = normal(config.vocab_size, e)
    return state


def random_model(
    config: ModelConfig,
    seed: int,
    dtype: torch.dtype = torch.float32,
    device: torch.device | str = "cpu",
    max_model_len: int | None = None,
) -> CausalLM:
    """A model with the weights of random_hf_state_dict(config, seed)."""
    return model_from_tensors(config, random_hf_state_dict(config, seed).items(), dtype, device,
                              max_model_len or config.max_position_embeddings)
