"""GGUF checkpoints (llama.cpp's format) read into the engine's HF-shaped world.

`GGUFCheckpoint.open(path)` reads the file's metadata; `hf_config()` is the config.json a HF
checkpoint of the same model would carry, `tensors(dtype)` yields its weights under HF names,
dequantized with the `gguf` package and cast to the serving dtype, and `tokenizer()` rebuilds
its tokenizer and chat template (`engine.checkpoints.gguf_tokenizer`). `convert(outdir)`
writes all of it as a checkpoint directory (config.json, safetensors shards,
tokenizer.json, tokenizer_config.json, chat_template.jinja) that
`engine.models.loader.load_model` serves like any HF checkpoint.

llama.cpp stores Llama-architecture q/k projections with their rows permuted for its rotary
kernel (the rows of each head interleaved); they are permuted back here. Qwen2/3 use the
rotate-half layout as stored. Weights tied to the embedding are kept tied (no output.weight).
Llama 3.1+'s per-frequency rope divisors become config.json's llama3 rope_scaling
(`engine.checkpoints.gguf_rope`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Container, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFReader
from gguf.quants import dequantize
from safetensors.torch import save_file

from engine.checkpoints.gguf_rope import llama3_scaling
from engine.checkpoints.gguf_tokenizer import (
    GGUFTokenizerFields,
    build_backend_tokenizer,
    tokenizer_config,
)
from engine.models.config import ModelConfigError
from engine.text.tokenizer import Tokenizer

__all__ = ["SUPPORTED_TENSOR_TYPES", "GGUFCheckpoint"]

# Tensor types read here (checked against gguf's own dequantization in the tests).
SUPPORTED_TENSOR_TYPES = frozenset(
    {
        GGMLQuantizationType.F32,
        GGMLQuantizationType.F16,
        GGMLQuantizationType.BF16,
        GGMLQuantizationType.Q8_0,
        GGMLQuantizationType.Q4_0,
        GGMLQuantizationType.Q4_1,
        GGMLQuantizationType.Q5_0,
        GGMLQuantizationType.Q5_1,
        GGMLQuantizationType.Q2_K,
        GGMLQuantizationType.Q3_K,
        GGMLQuantizationType.Q4_K,
        GGMLQuantizationType.Q5_K,
        GGMLQuantizationType.Q6_K,
    }
)


@dataclass(frozen=True)
class _Architecture:
    hf_class: str  # config.json "architectures"
    model_type: str
    permuted_qk: bool  # llama.cpp permuted q/k rows for its rotary layout


# general.architecture -> HF. Mistral 7B-style models are written as "llama".
_ARCHITECTURES = {
    "llama": _Architecture("LlamaForCausalLM", "llama", permuted_qk=True),
    "qwen2": _Architecture("Qwen2ForCausalLM", "qwen2", permuted_qk=False),
    "qwen3": _Architecture("Qwen3ForCausalLM", "qwen3", permuted_qk=False),
}

# GGUF tensor name -> HF name ({} is the layer index).
_LAYER_TENSORS = {
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
}
_GLOBAL_TENSORS = {
    "token_embd.weight": "model.embed_tokens.weight",
    "output_norm.weight": "model.norm.weight",
    "output.weight": "lm_head.weight",
}
_ROPE_FREQS = "rope_freqs.weight"  # per-frequency rope divisors (Llama 3.1+), engine.gguf_rope
_LAYER_NAME = re.compile(r"^blk\.(\d+)\.(\w+)\.(weight|bias)$")

_SHARD_BYTES = 2 << 30  # safetensors shard size convert() aims at


class GGUFCheckpoint:
    """One GGUF file: its metadata read at open, its tensors dequantized on demand."""

    def __init__(self, path: Path, reader: GGUFReader) -> None:
        self.path = path
        self._reader = reader
        self._fields = reader.fields
        self._tensor_names = frozenset(t.name for t in reader.tensors)
        name = self._field("general.architecture")
        if name not in _ARCHITECTURES:
            raise ModelConfigError(
                f"{path.name}: unsupported GGUF architecture {name!r}; "
                f"supported: {', '.join(sorted(_ARCHITECTURES))}"
            )
        self.architecture_name: str = name
        self._arch = _ARCHITECTURES[name]
        unsupported = sorted(
            {
                t.tensor_type.name
                for t in reader.tensors
                if t.tensor_type not in SUPPORTED_TENSOR_TYPES
            }
        )
        if unsupported:
            raise ModelConfigError(
                f"{path.name}: unsupported GGUF tensor types {', '.join(unsupported)}; supported: "
                + ", ".join(sorted(t.name for t in SUPPORTED_TENSOR_TYPES))
            )

    @classmethod
    def open(cls, path: str | Path) -> GGUFCheckpoint:
        path = Path(path)
        try:
            reader = GGUFReader(path)
        except (OSError, ValueError) as exc:
            raise ModelConfigError(f"cannot read GGUF file {path}: {exc}") from exc
        return cls(path, reader)

    # -- metadata ------------------------------------------------------------------------------

    def _field(self, key: str, default: Any = None) -> Any:
        field = self._fields.get(key)
        return default if field is None else field.contents()

    def _arch_field(self, key: str, default: Any = None) -> Any:
        return self._field(f"{self.architecture_name}.{key}", default)

    def _required(self, key: str) -> Any:
        value = self._arch_field(key)
        if value is None:
            raise ModelConfigError(
                f"{self.path.name}: GGUF metadata lacks {self.architecture_name}.{key}"
            )
        return value

    def hf_config(self, dtype: torch.dtype = torch.float32) -> dict[str, Any]:
        """config.json for the model (HF field names), its dtype the one tensors() yields."""
        num_heads = int(self._required("attention.head_count"))
        hidden_size = int(self._required("embedding_length"))
        tokens = self._field("tokenizer.ggml.tokens") or []
        config: dict[str, Any] = {
            "architectures": [self._arch.hf_class],
            "model_type": self._arch.model_type,
            "vocab_size": int(self._arch_field("vocab_size") or len(tokens)),
            "hidden_size": hidden_size,
            "intermediate_size": int(self._required("feed_forward_length")),
            "num_hidden_layers": int(self._required("block_count")),
            "num_attention_heads": num_heads,
            "num_key_value_heads": int(self._arch_field("attention.head_count_kv") or num_heads),
            "head_dim": self._head_dim(),
            "rms_norm_eps": float(self._arch_field("attention.layer_norm_rms_epsilon", 1e-6)),
            "rope_theta": float(self._arch_field("rope.freq_base", 10000.0)),
            "max_position_embeddings": int(self._arch_field("context_length", 4096)),
            "tie_word_embeddings": "output.weight" not in self._tensor_names,
            "hidden_act": "silu",
            "torch_dtype": str(dtype).removeprefix("torch."),
            "bos_token_id": self._field("tokenizer.ggml.bos_token_id"),
            "eos_token_id": self._field("tokenizer.ggml.eos_token_id"),
        }
        scaling = self._rope_scaling()
        if scaling is not None:
            config["rope_scaling"] = scaling
        if self._arch.model_type == "llama":
            names = self._tensor_names
            config["attention_bias"] = "blk.0.attn_q.bias" in names
            config["mlp_bias"] = "blk.0.ffn_up.bias" in names
        return config

    def _head_dim(self) -> int:
        num_heads = int(self._required("attention.head_count"))
        hidden_size = int(self._required("embedding_length"))
        return int(self._arch_field("attention.key_length") or hidden_size // num_heads)

    def _rope_scaling(self) -> dict[str, Any] | None:
        if _ROPE_FREQS in self._tensor_names:
            # Llama 3.1+ keep their rope scaling as a per-frequency tensor, not as parameters.
            (tensor,) = (t for t in self._reader.tensors if t.name == _ROPE_FREQS)
            try:
                return llama3_scaling(
                    dequantize(tensor.data, tensor.tensor_type),
                    float(self._arch_field("rope.freq_base", 10000.0)),
                    self._head_dim(),
                )
            except ModelConfigError as exc:
                raise ModelConfigError(f"{self.path.name}: {exc}") from None
        kind = self._arch_field("rope.scaling.type")
        if kind in (None, "none"):
            return None
        if kind != "linear":
            raise ModelConfigError(f"{self.path.name}: unsupported rope scaling {kind!r}")
        return {
            "rope_type": "linear",
            "factor": float(self._arch_field("rope.scaling.factor", 1.0)),
        }

    def tokenizer_fields(self) -> GGUFTokenizerFields:
        def optional_id(key: str) -> int | None:
            value = self._field(f"tokenizer.ggml.{key}")
            return None if value is None else int(value)

        model = str(self._field("tokenizer.ggml.model", ""))
        return GGUFTokenizerFields(
            model=model,
            pre=self._field("tokenizer.ggml.pre"),
            tokens=self._field("tokenizer.ggml.tokens") or [],
            token_types=self._field("tokenizer.ggml.token_type") or [],
            merges=self._field("tokenizer.ggml.merges") or [],
            scores=self._field("tokenizer.ggml.scores") or [],
            bos_token_id=optional_id("bos_token_id"),
            eos_token_id=optional_id("eos_token_id"),
            unk_token_id=optional_id("unknown_token_id"),
            pad_token_id=optional_id("padding_token_id"),
            # llama.cpp puts BOS in front of a SentencePiece vocabulary's text unless told not to
            add_bos_token=bool(self._field("tokenizer.ggml.add_bos_token", model == "llama")),
            add_eos_token=bool(self._field("tokenizer.ggml.add_eos_token", False)),
            add_space_prefix=bool(self._field("tokenizer.ggml.add_space_prefix", True)),
            chat_template=self._field("tokenizer.chat_template"),
        )

    def tokenizer(self) -> Tokenizer:
        fields = self.tokenizer_fields()
        return Tokenizer(
            build_backend_tokenizer(fields), tokenizer_config(fields), fields.chat_template
        )

    # -- tensors -------------------------------------------------------------------------------

    def tensors(self, dtype: torch.dtype = torch.float32, skip: Container[str] = (),
                ) -> Iterator[tuple[str, torch.Tensor]]:
        """(HF name, tensor) for every weight but those named in skip, dequantized and cast to
        dtype."""
        num_heads = int(self._required("attention.head_count"))
        num_kv_heads = int(self._arch_field("attention.head_count_kv") or num_heads)
        for tensor in self._reader.tensors:
            if tensor.name == _ROPE_FREQS:
                continue  # in config.json as rope_scaling (hf_config)
            hf_name, layer_part = self._hf_name(tensor.name)
            if hf_name in skip:
                continue
            values = dequantize(tensor.data, tensor.tensor_type)
            # ne is GGML's order (fastest first): numpy's shape is its reverse.
            shape = tuple(int(n) for n in reversed(tensor.shape.tolist()))
            values = values.astype(np.float32, copy=not values.flags.writeable).reshape(shape)
            if self._arch.permuted_qk and layer_part in ("attn_q", "attn_k"):
                values = _unpermute_rows(
                    values, num_heads if layer_part == "attn_q" else num_kv_heads
                )
            yield hf_name, torch.from_numpy(values).to(dtype)

    def raw_tensors(self) -> Iterator[tuple[str, GGMLQuantizationType, np.ndarray]]:
        """(HF name, tensor type, raw blocks as uint8 [rows, bytes per row]) for every weight
        matrix, its rows in the HF order (q/k un-permuted): the blocks as stored, for the
        kernels that take them so (engine.models.quantized.panels)."""
        num_heads = int(self._required("attention.head_count"))
        num_kv_heads = int(self._arch_field("attention.head_count_kv") or num_heads)
        for tensor in self._reader.tensors:
            if tensor.name == _ROPE_FREQS or len(tensor.shape) != 2:
                continue
            hf_name, layer_part = self._hf_name(tensor.name)
            rows = int(tensor.shape[1])
            raw = np.asarray(tensor.data).view(np.uint8).reshape(rows, -1)
            if self._arch.permuted_qk and layer_part in ("attn_q", "attn_k"):
                raw = _unpermute_rows(raw, num_heads if layer_part == "attn_q" else num_kv_heads)
            yield hf_name, tensor.tensor_type, raw

    def _hf_name(self, name: str) -> tuple[str, str | None]:
        if name in _GLOBAL_TENSORS:
            return _GLOBAL_TENSORS[name], None
        match = _LAYER_NAME.match(name)
        if match is None or match.group(2) not in _LAYER_TENSORS:
            raise ModelConfigError(
                f"{self.path.name}: GGUF tensor {name!r} has no place in the model"
            )
        layer, part, kind = match.groups()
        return f"model.layers.{layer}.{_LAYER_TENSORS[part]}.{kind}", part

    # -- conversion ----------------------------------------------------------------------------

    def convert(self, outdir: str | Path, dtype: torch.dtype = torch.float32,
                weights: bool = True) -> Path:
        """Write the model as a HF checkpoint directory (safetensors in dtype); returns it.
        weights False: config.json and the tokenizer only (for an engine that reads the
        weights from this file, engine.checkpoints.gguf_panels)."""
        outdir = Path(outdir)
        outdir.mkdir(parents=True, exist_ok=True)
        tokenizer = self.tokenizer()  # before the weights: a bad tokenizer fails fast
        weight_map: dict[str, str] = {}
        shard: dict[str, torch.Tensor] = {}
        shard_bytes = 0
        files: list[str] = []

        def flush() -> None:
            nonlocal shard, shard_bytes
            file = f"model-{len(files) + 1:05d}.safetensors"
            save_file(shard, str(outdir / file), metadata={"format": "pt"})
            files.append(file)
            weight_map.update({name: file for name in shard})
            shard, shard_bytes = {}, 0

        for name, tensor in self.tensors(dtype) if weights else ():
            shard[name] = tensor
            shard_bytes += tensor.numel() * tensor.element_size()
            if shard_bytes >= _SHARD_BYTES:
                flush()
        if shard:
            flush()
        if len(files) == 1:
            (outdir / files[0]).rename(outdir / "model.safetensors")
        elif files:
            index = {"metadata": {}, "weight_map": weight_map}
            (outdir / "model.safetensors.index.json").write_text(json.dumps(index, indent=1))
        (outdir / "config.json").write_text(json.dumps(self.hf_config(dtype), indent=2))
        tokenizer.save(outdir)
        return outdir


def _unpermute_rows(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """Undo llama.cpp's q/k row permutation: within each head, rows were reordered from
    [first half | second half] (HF's rotate-half) to interleaved pairs."""
    rows = weight.shape[0]
    head_rows = rows // num_heads
    return (
        weight.reshape(num_heads, head_rows // 2, 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )
