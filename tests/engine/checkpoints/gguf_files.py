"""Small GGUF files written the way llama.cpp's converter writes them, for the GGUF tests.

`write_gguf` takes HF-named tensors and a HF config and writes GGUF names, llama.cpp's q/k row
permutation for Llama (the inverse of what engine.gguf_checkpoint undoes), metadata and a
byte-level BPE or SentencePiece tokenizer; each tensor in the type asked for (norms stay F32,
as llama.cpp keeps them). Written independently of the code under test: only the `gguf`
package's writer and quantizers are shared.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from gguf import GGMLQuantizationType, GGUFWriter
from gguf.constants import GGML_QUANT_SIZES
from gguf.quants import quantize

# HF name part -> GGUF name part, per layer.
_LAYER_NAMES = {
    "input_layernorm": "attn_norm",
    "post_attention_layernorm": "ffn_norm",
    "self_attn.q_proj": "attn_q",
    "self_attn.k_proj": "attn_k",
    "self_attn.v_proj": "attn_v",
    "self_attn.o_proj": "attn_output",
    "self_attn.q_norm": "attn_q_norm",
    "self_attn.k_norm": "attn_k_norm",
    "mlp.gate_proj": "ffn_gate",
    "mlp.up_proj": "ffn_up",
    "mlp.down_proj": "ffn_down",
}
_GLOBAL_NAMES = {
    "model.embed_tokens.weight": "token_embd.weight",
    "model.norm.weight": "output_norm.weight",
    "lm_head.weight": "output.weight",
}
# Types gguf's own quantizer writes; the others get random blocks.
_QUANTIZABLE = {
    GGMLQuantizationType.F16,
    GGMLQuantizationType.BF16,
    GGMLQuantizationType.Q8_0,
    GGMLQuantizationType.Q4_0,
    GGMLQuantizationType.Q4_1,
    GGMLQuantizationType.Q5_0,
    GGMLQuantizationType.Q5_1,
}


@dataclass
class TokenizerFields:
    """tokenizer.ggml.* to write."""

    tokens: list[str]
    token_types: list[int]
    merges: list[str]
    pre: str = "gpt-2"
    model: str = "gpt2"  # "llama": SentencePiece (scores, no merges)
    scores: list[float] | None = None
    add_space_prefix: bool | None = None
    bos_token_id: int | None = None
    eos_token_id: int | None = None
    unk_token_id: int | None = None
    add_bos_token: bool | None = False  # None: not written
    chat_template: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)


def byte_tokens() -> TokenizerFields:
    """A 256-token byte-level vocabulary with no merges (for models of vocab 256)."""
    printable = [*range(ord("!"), ord("~") + 1), *range(0xA1, 0xAD), *range(0xAE, 0x100)]
    alphabet = {b: chr(b) for b in printable}
    extra = 0
    for b in range(256):
        if b not in alphabet:
            alphabet[b] = chr(256 + extra)
            extra += 1
    return TokenizerFields([alphabet[b] for b in range(256)], [1] * 256, [])


def gguf_name(hf_name: str) -> str:
    if hf_name in _GLOBAL_NAMES:
        return _GLOBAL_NAMES[hf_name]
    parts = hf_name.removeprefix("model.layers.").split(".")
    layer, kind = parts[0], parts[-1]
    return f"blk.{layer}.{_LAYER_NAMES['.'.join(parts[1:-1])]}.{kind}"


def llama_cpp_permute(weight: np.ndarray, num_heads: int) -> np.ndarray:
    """llama.cpp's convert_hf_to_gguf permutation of Llama q/k rows (per head: the two
    rotary halves interleaved)."""
    return (
        weight.reshape(num_heads, 2, weight.shape[0] // num_heads // 2, *weight.shape[1:])
        .swapaxes(1, 2)
        .reshape(weight.shape)
    )


def quantized_bytes(values: np.ndarray, qtype: GGMLQuantizationType, seed: int) -> np.ndarray:
    """values in qtype: gguf's quantizer where it has one, else random blocks of the right
    size (bytes below 0x40, so every float16 scale in them is finite)."""
    if qtype == GGMLQuantizationType.F32:
        return values.astype(np.float32)
    if qtype in _QUANTIZABLE:
        return quantize(values.astype(np.float32), qtype)
    block_size, type_size = GGML_QUANT_SIZES[qtype]
    rows, cols = values.shape
    assert cols % block_size == 0, f"{qtype.name} rows need a multiple of {block_size}"
    rng = np.random.default_rng(seed)
    return rng.integers(0, 0x40, size=(rows, cols // block_size * type_size), dtype=np.uint8)


def write_gguf(
    path: Path,
    arch: str,
    config: dict[str, Any],
    tensors: dict[str, torch.Tensor],
    tokenizer: TokenizerFields,
    tensor_type: GGMLQuantizationType = GGMLQuantizationType.F32,
    extra_tensors: dict[str, np.ndarray] | None = None,
) -> dict[str, np.ndarray]:
    """Write a GGUF file; returns what was stored per GGUF name (quantized bytes or floats)."""
    writer = GGUFWriter(path, arch)
    num_heads = config["num_attention_heads"]
    num_kv_heads = config.get("num_key_value_heads", num_heads)
    writer.add_block_count(config["num_hidden_layers"])
    writer.add_context_length(config["max_position_embeddings"])
    writer.add_embedding_length(config["hidden_size"])
    writer.add_feed_forward_length(config["intermediate_size"])
    writer.add_head_count(num_heads)
    writer.add_head_count_kv(num_kv_heads)
    if config.get("head_dim"):
        writer.add_key_length(config["head_dim"])
        writer.add_value_length(config["head_dim"])
    writer.add_rope_freq_base(config.get("rope_theta", 10000.0))
    writer.add_layer_norm_rms_eps(config["rms_norm_eps"])
    writer.add_vocab_size(config["vocab_size"])
    writer.add_tokenizer_model(tokenizer.model)
    writer.add_tokenizer_pre(tokenizer.pre)
    writer.add_token_list(tokenizer.tokens)
    writer.add_token_types(tokenizer.token_types)
    if tokenizer.merges:
        writer.add_token_merges(tokenizer.merges)
    if tokenizer.scores is not None:
        writer.add_token_scores(tokenizer.scores)
    if tokenizer.add_space_prefix is not None:
        writer.add_add_space_prefix(tokenizer.add_space_prefix)
    if tokenizer.bos_token_id is not None:
        writer.add_bos_token_id(tokenizer.bos_token_id)
    if tokenizer.eos_token_id is not None:
        writer.add_eos_token_id(tokenizer.eos_token_id)
    if tokenizer.unk_token_id is not None:
        writer.add_unk_token_id(tokenizer.unk_token_id)
    if tokenizer.add_bos_token is not None:
        writer.add_add_bos_token(tokenizer.add_bos_token)
    if tokenizer.chat_template is not None:
        writer.add_chat_template(tokenizer.chat_template)
    for key, value in tokenizer.extra.items():
        writer.add_string(key, value)
    stored: dict[str, np.ndarray] = {}
    for index, (hf_name, tensor) in enumerate(tensors.items()):
        if hf_name == "lm_head.weight" and config.get("tie_word_embeddings"):
            continue  # llama.cpp writes no output.weight for tied embeddings
        name = gguf_name(hf_name)
        values = tensor.detach().float().numpy()
        if arch == "llama" and (".attn_q." in name or ".attn_k." in name):
            values = llama_cpp_permute(values, num_heads if ".attn_q." in name else num_kv_heads)
        qtype = tensor_type if values.ndim == 2 else GGMLQuantizationType.F32
        data = quantized_bytes(values, qtype, seed=index)
        stored[name] = data
        raw_dtype = None if qtype == GGMLQuantizationType.F32 else qtype
        writer.add_tensor(name, data, raw_dtype=raw_dtype)
    for name, values in (extra_tensors or {}).items():  # GGUF-named, written as given
        stored[name] = values
        writer.add_tensor(name, values)
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return stored
