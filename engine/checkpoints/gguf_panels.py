"""A GGUF file's quantized matrices served as stored, in the CPU kernels' panels.

`stored_matrices(checkpoint, num_layers)` repacks every matrix whose blocks the kernels read
(engine.models.quantized.panels.PANEL_TYPES) into quantized panels under the model's module
names: q, k and v stacked into `layers.{i}.self_attn.qkv_proj`, gate and up interleaved into
`layers.{i}.mlp.gate_up_proj` (the decode forward's order), `embed_tokens`, and `lm_head` (the
embedding's panels when the model ties them). A fused product whose parts differ in type, or
a type the kernels do not read, is left out: it is dequantized at load like any weight.

`load_stored_model` builds the model around them: those modules become `PanelLinear` and
`PanelEmbedding` over the panels (engine.models.cpu_decode), and only the other tensors
(norms, biases, matrices left out) are dequantized, to float32. No float copy of a stored
matrix exists at any point; the decode forward reads the same panels, and the layer path
(prefills, mixed steps) multiplies over them as well.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import torch
from gguf import GGML_QUANT_SIZES
from torch import nn

from engine.checkpoints.gguf_checkpoint import GGUFCheckpoint
from engine.models import cpu_decode
from engine.models.config import ModelConfig
from engine.models.cpu_decode import PanelEmbedding, PanelLinear
from engine.models.decoder import CausalLM
from engine.models.loader import load_weights, model_from_tensors
from engine.models.quantized.panels import (
    PANEL,
    PANEL_TYPES,
    QBLOCK,
    PanelMatrix,
    gguf_panels,
    interleave_panels,
    stack_panels,
)

__all__ = ["StoredMatrix", "load_gguf_model", "load_stored_model", "stored_matrices"]


@dataclass(frozen=True)
class StoredMatrix:
    """A module's matrix in panels, and the HF-named tensors it holds."""

    panels: PanelMatrix
    hf_names: tuple[str, ...]


def stored_matrices(checkpoint: GGUFCheckpoint, num_layers: int) -> dict[str, StoredMatrix]:
    """The model's matrices that the file's blocks serve as stored, by module name."""
    raw = {name: (kind, rows) for name, kind, rows in checkpoint.raw_tensors()}

    def panels(name: str) -> PanelMatrix | None:
        if name not in raw:
            return None
        kind, rows = raw[name]
        if kind not in PANEL_TYPES:
            return None
        block, block_bytes = GGML_QUANT_SIZES[kind]
        num_out, num_in = rows.shape[0], rows.shape[1] // block_bytes * block
        if num_out % PANEL or num_in % QBLOCK:
            return None
        return gguf_panels(rows, kind, num_out, num_in)

    found: dict[str, StoredMatrix] = {}

    def keep(module: str, matrix: PanelMatrix | None, *hf_names: str) -> None:
        if matrix is not None:
            found[module] = StoredMatrix(matrix, hf_names)

    embed_name = "model.embed_tokens.weight"
    embedding = panels(embed_name)
    keep("embed_tokens", embedding, embed_name)
    if "lm_head.weight" in raw:
        keep("lm_head", panels("lm_head.weight"), "lm_head.weight")
    else:  # tied: the embedding's panels
        keep("lm_head", embedding, embed_name)
    for index in range(num_layers):
        hf, ours = f"model.layers.{index}.", f"layers.{index}."
        names = [f"{hf}self_attn.{part}_proj.weight" for part in "qkv"]
        parts = [panels(name) for name in names]
        keep(ours + "self_attn.qkv_proj",
             None if None in parts else stack_panels(cast(list[PanelMatrix], parts)), *names)
        name = f"{hf}self_attn.o_proj.weight"
        keep(ours + "self_attn.o_proj", panels(name), name)
        names = [f"{hf}mlp.gate_proj.weight", f"{hf}mlp.up_proj.weight"]
        gate, up = (panels(name) for name in names)
        keep(ours + "mlp.gate_up_proj",
             None if gate is None or up is None else interleave_panels(gate, up), *names)
        name = f"{hf}mlp.down_proj.weight"
        keep(ours + "mlp.down_proj", panels(name), name)
    return found


def load_stored_model(checkpoint: GGUFCheckpoint, config: ModelConfig,
                      max_model_len: int) -> CausalLM:
    """The model on the CPU with the file's matrices as stored (stored_matrices) and the rest
    in float32. cpu_decode.supports(config, cpu, float32) must hold."""
    stored = stored_matrices(checkpoint, config.num_layers)
    with torch.device("meta"):
        model = CausalLM(config, max_positions=max_model_len)
    for name, matrix in stored.items():
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        module: nn.Module
        if name == "embed_tokens":
            module = PanelEmbedding(matrix.panels)
        else:
            old_bias = getattr(getattr(parent, attribute), "bias", None)
            bias = None if old_bias is None else nn.Parameter(
                torch.empty(matrix.panels.out_features), requires_grad=False)
            module = PanelLinear(matrix.panels, bias, interleaved=name.endswith("gate_up_proj"))
        setattr(parent, attribute, module)
    model = model.to_empty(device=torch.device("cpu")).to(torch.float32)
    if config.tie_word_embeddings and isinstance(model.lm_head, nn.Linear):
        model.lm_head.weight = cast(nn.Embedding, model.embed_tokens).weight
    skip = {hf_name for matrix in stored.values() for hf_name in matrix.hf_names}
    load_weights(model, checkpoint.tensors(torch.float32, skip=skip))
    model.build_rotary_table()
    return model.eval()


def load_gguf_model(checkpoint: GGUFCheckpoint, config: ModelConfig, device: torch.device,
                    max_model_len: int) -> CausalLM:
    """The model as `--dtype auto` serves a GGUF file: on the CPU, where the kernels build and
    take the model (cpu_decode.supports), its matrices as stored (load_stored_model); else
    every weight dequantized to float32 on device, from the file."""
    if device.type == "cpu" and cpu_decode.supports(config, device, torch.float32):
        return load_stored_model(checkpoint, config, max_model_len)
    return model_from_tensors(config, checkpoint.tensors(torch.float32), torch.float32, device,
                              max_model_len)
