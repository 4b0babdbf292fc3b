"""Load an AWQ, GPTQ or fp8 HF checkpoint with its linear layers as stored.

The checkpoint's names say which projections are quantized (AWQ/GPTQ: a `qweight`; fp8: a
`weight_scale`); those modules of the model become QuantizedLinear, fused ones (q/k/v into
qkv_proj, gate/up into gate_up_proj) only when every part is. The model is built on the meta
device, so no float matrix of a quantized projection is ever allocated; the checkpoint is read
tensor by tensor, each projection's quantized tensors repacked (engine.models.quantized.layouts)
into its columns (rows for fp8) of the module as soon as the last of them is read, and every
other tensor (embeddings, norms, biases, projections left in float) goes to load_weights.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import cast

import torch
from torch import nn

from engine.models.config import ModelConfig, ModelConfigError, QuantizationConfig, QuantMethod
from engine.models.decoder import CausalLM
from engine.models.loader import (
    checkpoint_dtypes,
    checkpoint_tensors,
    fused_target,
    load_weights,
    shard_slices,
)
from engine.models.quantized.layouts import QuantizedTensors, from_awq, from_fp8, from_gptq
from engine.models.quantized.linear import QuantizedFormat, QuantizedLinear, WeightKind

__all__ = ["load_quantized_model", "quantized_modules"]

# The tensors of one quantized projection, by method (the first names the projection), and
# those it may carry besides: a GPTQ g_idx (checked), an fp8 input_scale (unused: dynamic).
_PARTS = {
    QuantMethod.AWQ: ("qweight", "qzeros", "scales"),
    QuantMethod.GPTQ: ("qweight", "qzeros", "scales"),
    QuantMethod.FP8: ("weight_scale", "weight"),
}
_OPTIONAL_PARTS = {QuantMethod.AWQ: (), QuantMethod.GPTQ: ("g_idx",),
                   QuantMethod.FP8: ("input_scale",)}


@dataclass
class _Projection:
    """A quantized HF projection while its tensors are read."""

    target: str  # our module, e.g. "layers.0.self_attn.qkv_proj"
    outputs: slice  # its outputs in that module (the shard's rows of a fused one)
    expected: frozenset[str]  # the parts the checkpoint holds, e.g. {"qweight", "scales", ...}
    parts: dict[str, torch.Tensor] = field(default_factory=dict)  # read so far, by part
    is_loaded: bool = False


def quantized_modules(names: list[str], config: ModelConfig) -> dict[str, list[str]]:
    """Our modules whose matrices the checkpoint stores quantized, and the HF projections
    (names without "model.") of each, in shard order."""
    quantization = config.quantization
    assert quantization is not None, "a quantized checkpoint's config"
    marker = "." + _PARTS[quantization.method][0]
    found: dict[str, dict[int, str]] = {}
    for name in names:
        if name.endswith(marker):
            hf_module = name.removeprefix("model.").removesuffix(marker)
            target, shard = fused_target(hf_module)
            found.setdefault(target, {})[shard] = hf_module
    slices = shard_slices(config)
    modules = {}
    for target, shards in found.items():
        fused = target.rpartition(".")[2]
        expected = list(range(len(slices[fused]))) if fused in slices else [-1]
        if sorted(shards) != expected:
            raise ModelConfigError(f"{target}: only some of its projections are quantized "
                                   f"({sorted(shards.values())}); all or none must be")
        modules[target] = [shards[i] for i in expected]
    return modules


_SCALE_DTYPES = {"F16": torch.float16, "BF16": torch.bfloat16}


def _format(quantization: QuantizationConfig, dtypes: dict[str, str]) -> QuantizedFormat:
    if quantization.method is QuantMethod.FP8:
        return QuantizedFormat(WeightKind.FP8, 8, 0, torch.float32, quantization.name)
    # scales stay in their stored dtype (every projection's alike, checked at the copy)
    stored = next((dtype for name, dtype in dtypes.items() if name.endswith(".scales")), "F16")
    if stored not in _SCALE_DTYPES:
        raise ModelConfigError(f"{quantization.method} scales of dtype {stored} (expected F16 "
                               "or BF16)")
    return QuantizedFormat(WeightKind.INT, quantization.bits, quantization.group_size,
                           _SCALE_DTYPES[stored], quantization.name)


def _empty_model(config: ModelConfig, modules: dict[str, list[str]],
                 weight_format: QuantizedFormat, dtype: torch.dtype, device: torch.device,
                 max_model_len: int) -> CausalLM:
    """The model with empty weights on device: QuantizedLinear where modules says, cast to
    dtype before they are put in (their tensors keep the format's dtypes)."""
    with torch.device("meta"):
        model = CausalLM(config, max_positions=max_model_len).to(dtype)
    for name in modules:
        parent_name, _, attribute = name.rpartition(".")
        parent = model.get_submodule(parent_name)
        linear = cast(nn.Linear, getattr(parent, attribute))
        if linear.in_features % max(weight_format.group_size, 1):
            raise ModelConfigError(f"{name}: {linear.in_features} inputs are not whole groups "
                                   f"of {weight_format.group_size}")
        setattr(parent, attribute, QuantizedLinear(
            linear.in_features, linear.out_features, weight_format, linear.bias is not None,
            dtype, device="meta"))
    model = model.to_empty(device=device)
    if config.tie_word_embeddings and isinstance(model.lm_head, nn.Linear):
        model.lm_head.weight = cast(nn.Embedding, model.embed_tokens).weight
    return model


def _repack(projection: str, parts: dict[str, torch.Tensor], module: QuantizedLinear,
            num_out: int, quantization: QuantizationConfig) -> QuantizedTensors:
    num_in, group_size = module.in_features, quantization.group_size
    if quantization.method is QuantMethod.AWQ:
        return from_awq(projection, parts["qweight"], parts["qzeros"], parts["scales"],
                        num_in, num_out, group_size)
    if quantization.method is QuantMethod.GPTQ:
        return from_gptq(projection, parts["qweight"], parts["qzeros"], parts["scales"],
                         parts.get("g_idx"), num_in, num_out, quantization.bits, group_size,
                         quantization.zero_offset)
    return from_fp8(projection, parts["weight"], parts["weight_scale"], num_in, num_out)


def _store(projection: str, module: QuantizedLinear, tensors: QuantizedTensors,
           outputs: slice) -> None:
    """Copy one projection's tensors into its outputs of the module (columns or rows)."""
    pairs = [(module.qweight, tensors.qweight), (module.scales, tensors.scales),
             (module.zeros, tensors.zeros)]
    for destination, source in pairs:
        if destination is None or source is None:
            assert destination is source, "zero points in the integer layout only"
            continue
        if destination.dtype != source.dtype:  # scales: one dtype for the whole model
            raise ModelConfigError(f"{projection}: {source.dtype} tensors where the others' "
                                   f"are {destination.dtype}")
        destination.narrow(module.output_dim, outputs.start,
                           outputs.stop - outputs.start).copy_(source)


class _QuantizedReader:
    """Splits a checkpoint's tensors: the quantized projections' go into their modules as each
    projection's last tensor is read, the rest on to load_weights."""

    def __init__(self, model: CausalLM, modules: dict[str, list[str]], names: set[str],
                 quantization: QuantizationConfig) -> None:
        self.model, self.quantization = model, quantization
        slices = shard_slices(model.config)
        required, optional = _PARTS[quantization.method], _OPTIONAL_PARTS[quantization.method]
        self.projections: dict[str, _Projection] = {}
        for target, projections in modules.items():
            fused = target.rpartition(".")[2]
            num_out = cast(QuantizedLinear, model.get_submodule(target)).out_features
            for shard, projection in enumerate(projections):
                prefix = f"model.{projection}." if f"model.{projection}.{required[0]}" in names \
                    else f"{projection}."
                parts = set(required) | {p for p in optional if prefix + p in names}
                outputs = slices[fused][shard] if fused in slices else slice(0, num_out)
                self.projections[projection] = _Projection(target, outputs, frozenset(parts))

    def others(self, tensors: Iterator[tuple[str, torch.Tensor]],
               ) -> Iterator[tuple[str, torch.Tensor]]:
        """The tensors that are not a quantized projection's; at the end, every quantized
        projection must be complete."""
        for hf_name, tensor in tensors:
            projection, _, part = hf_name.removeprefix("model.").rpartition(".")
            state = self.projections.get(projection)
            if state is None or part not in state.expected:
                yield hf_name, tensor
                continue
            if state.is_loaded or part in state.parts:
                raise ModelConfigError(f"{hf_name} appears twice in the checkpoint")
            state.parts[part] = tensor
            if len(state.parts) == len(state.expected):
                self._load(projection, state)
        incomplete = [p for p, state in self.projections.items() if not state.is_loaded]
        if incomplete:
            raise ModelConfigError(f"checkpoint lacks quantized tensors of {len(incomplete)} "
                                   f"projections, e.g. {incomplete[:3]}")

    def _load(self, projection: str, state: _Projection) -> None:
        module = cast(QuantizedLinear, self.model.get_submodule(state.target))
        num_out = state.outputs.stop - state.outputs.start
        tensors = _repack(projection, state.parts, module, num_out, self.quantization)
        _store(projection, module, tensors, state.outputs)
        state.parts.clear()  # the checkpoint's copies go now, not at the end
        state.is_loaded = True


def load_quantized_model(model_dir: str | Path, config: ModelConfig, dtype: torch.dtype,
                         device: torch.device | str, max_model_len: int) -> CausalLM:
    """The model of an AWQ, GPTQ or fp8 checkpoint (config.quantization) in dtype on device,
    its quantized projections as QuantizedLinear."""
    quantization = config.quantization
    assert quantization is not None, "a quantized checkpoint's config"
    dtypes = checkpoint_dtypes(model_dir)
    modules = quantized_modules(list(dtypes), config)
    if not modules:
        raise ModelConfigError(f"{model_dir}: config.json says {quantization.method} but no "
                               f"tensor ends in .{_PARTS[quantization.method][0]}")
    model = _empty_model(config, modules, _format(quantization, dtypes), dtype,
                         torch.device(device), max_model_len)
    reader = _QuantizedReader(model, modules, set(dtypes), quantization)
    load_weights(model, reader.others(checkpoint_tensors(model_dir)))
    model.build_rotary_table()
    return model.eval()
