"""A GGUF file's quantized matrices as the CPU decode forward takes them, as stored.

`decode_panels(checkpoint, num_layers)` repacks every matrix whose blocks the kernels read
(engine.models.quantized_panels.PANEL_TYPES) into quantized panels under the decode
forward's module names: q, k and v stacked into `layers.{i}.self_attn.qkv_proj`, gate and up
interleaved into `layers.{i}.mlp.gate_up_proj`, the lm_head (the embedding's blocks when the
model ties them). A fused product whose parts differ in type, or a type the kernels do not
read, is left out: the forward packs that one from the float weights.
"""

from __future__ import annotations

from gguf import GGML_QUANT_SIZES, GGMLQuantizationType

from engine.checkpoints.gguf_checkpoint import GGUFCheckpoint
from engine.models.quantized_panels import (
    PANEL,
    PANEL_TYPES,
    QBLOCK,
    PanelMatrix,
    gguf_panels,
    interleave_panels,
    stack_panels,
)

__all__ = ["decode_panels"]


def decode_panels(checkpoint: GGUFCheckpoint, num_layers: int) -> dict[str, PanelMatrix]:
    """The decode forward's matrices that the file's blocks serve as stored, by module name."""
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
        return gguf_panels(rows, GGMLQuantizationType(kind), num_out, num_in)

    def stacked(*names: str) -> PanelMatrix | None:
        parts = [panels(name) for name in names]
        present = [part for part in parts if part is not None]
        return stack_panels(present) if len(present) == len(parts) else None

    tied = "lm_head.weight" not in raw
    found = {"lm_head": panels("model.embed_tokens.weight" if tied else "lm_head.weight")}
    for index in range(num_layers):
        hf, ours = f"model.layers.{index}.", f"layers.{index}."
        found[ours + "self_attn.qkv_proj"] = stacked(
            *(f"{hf}self_attn.{part}_proj.weight" for part in "qkv"))
        found[ours + "self_attn.o_proj"] = panels(f"{hf}self_attn.o_proj.weight")
        gate, up = panels(f"{hf}mlp.gate_proj.weight"), panels(f"{hf}mlp.up_proj.weight")
        found[ours + "mlp.gate_up_proj"] = (
            None if gate is None or up is None else interleave_panels(gate, up))
        found[ours + "mlp.down_proj"] = panels(f"{hf}mlp.down_proj.weight")
    return {name: matrix for name, matrix in found.items() if matrix is not None}
