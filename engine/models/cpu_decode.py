"""A decode step of up to 64 rows as one C++ call on the CPU (cpu_decode.cpp), in float32.

At batch 1 the decoder's Python, torch's dispatcher and one OpenMP region per operation cost a
small float32 model on a CPU a large share of its step (ops/bench/journal.md, "The decode step
as one C++ call"), much of it in cache misses after each product has streamed its weights.
`CpuDecodeForward` runs the whole forward of a decode-only step of up to MAX_ROWS sequences in
one parallel region instead: its own products over weights in 16-wide panels, the fused row
ops, the paged attention kernel, the lm_head. Rows on LoRA adapters (a bound `LoraSlots`) take
their updates inside the same call, in the products (engine.models.cpu_decode_lora).

For float weights the panels are a second copy of the layers' weights (the packed oneDNN
copies still serve prefills, mixed steps and decode batches above the limit) and the
lm_head's only packed copy (those steps' lm_head, `PanelLinear`, reads it too): about the
model's float32 size again. A model served from a GGUF file's blocks as stored already holds
its matrices in quantized panels (`PanelLinear`, `PanelEmbedding`, built by
engine.checkpoints.gguf_panels), which the forward reads in place: no copy. The runner
builds it when `RunnerConfig.cpu_decode_rows` is above 0 and `supports` holds, which runs the
kernel once on a tiny random model against that model's layers and declines a library that
disagrees. The KV caches it is given must stay where they are (the runner never reallocates
them).
"""

from __future__ import annotations

import ctypes
import functools
import logging
from pathlib import Path
from typing import cast

import numpy as np
import torch
from torch import nn

from engine.attention import cpp_build, cpu_kernel
from engine.config import CPU_DECODE_MAX_ROWS
from engine.models import cpu_ops
from engine.models.batch import ForwardBatch
from engine.models.config import ModelConfig
from engine.models.cpu_decode_lora import CpuLoraKernels
from engine.models.decoder import CausalLM, DecoderLayer, KVCache
from engine.models.lora import FUSED_TARGETS, LoraSlots, LoraWeights, target_shapes
from engine.models.quantized.panels import (
    PanelFormat,
    PanelMatrix,
    float_panels,
    interleave_panels,
)

__all__ = ["MAX_ROWS", "CpuDecodeForward", "PanelEmbedding", "PanelLinear",
           "int8_activation_rows", "lora_kernels", "supports"]

logger = logging.getLogger(__name__)

SOURCE = Path(__file__).with_name("cpu_decode.cpp")
MAX_ROWS = CPU_DECODE_MAX_ROWS
_PANEL = 16  # outputs per weight panel
# The load-time check (_agrees_with_layers): a tiny random Llama with biases, its decode of
# 9 rows (a block of 8 rows and one of 1) against its own layers in plain torch, rows on two
# adapters (odd ranks: the kernel's padded and odd-length tails) and on the base model;
# relative error of the logits.
_CHECK_CONFIG = {
    "architectures": ["LlamaForCausalLM"], "model_type": "llama", "vocab_size": 64,
    "hidden_size": 32, "intermediate_size": 64, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "head_dim": 16, "rms_norm_eps": 1e-5,
    "max_position_embeddings": 64, "attention_bias": True, "mlp_bias": True,
}
_CHECK_ROWS = 9
_CHECK_ADAPTERS = (  # rank, targets
    (5, tuple(name for names in FUSED_TARGETS.values() for name in names)),
    (3, ("q_proj", "v_proj")),
)
_CHECK_ROW_SLOTS = (0, -1, 1, 1, 0, -1, 0, 1, 0)
_CHECK_TOLERANCE = 1e-4

_p, _i64, _f32 = ctypes.c_void_p, ctypes.c_int64, ctypes.c_float


class _Matrix(ctypes.Structure):  # TiergateMatrix
    _tail: _Matrix | None  # the rest of a stack of parts, kept alive with its head

    @classmethod
    def of(cls, matrix: PanelMatrix) -> _Matrix:
        """The matrix as the kernels read it: a stack of parts as a chain of its parts."""
        if not matrix.parts:
            return cls(matrix.data.data_ptr(), int(matrix.format), None, 0)
        tail: _Matrix | None = None
        for part in reversed(matrix.parts):
            head = cls(part.data.data_ptr(), int(part.format),
                       None if tail is None else ctypes.pointer(tail), part.out_features // _PANEL)
            head._tail = tail
            tail = head
        assert tail is not None
        return tail


_Matrix._fields_ = [("data", _p), ("format", _i64), ("next", ctypes.POINTER(_Matrix)),
                    ("panels", _i64)]


_MATRICES = ("qkv", "o", "gate_up", "down")


class _Layer(ctypes.Structure):
    _fields_ = [(name, _Matrix if name in _MATRICES else _p) for name in (
        "input_norm", "q_norm", "k_norm", "qkv", "qkv_bias", "o", "o_bias", "post_norm",
        "gate_up", "gate_up_bias", "down", "down_bias", "k_cache", "v_cache",
    )] + [("window", _i64)]


class _Model(ctypes.Structure):
    _fields_ = [(name, _i64) for name in (
        "num_layers", "hidden", "num_heads", "num_kv_heads", "head_dim", "intermediate", "vocab",
        "block_size", "num_blocks", "max_positions", "max_rows",
    )] + [("eps", _f32), ("scale", _f32)] + [
        (name, _Matrix if name in ("embed_panels", "lm_head") else _p)
        for name in ("embed", "embed_panels", "final_norm", "lm_head", "cos_table", "sin_table",
                     "layers")]


@functools.cache
def _library() -> ctypes.CDLL | None:
    library = cpp_build.load_library(SOURCE)
    if library is None:
        return None
    library.tiergate_decode_forward_f32.argtypes = [
        _p, _i64, _p, _p, _p, _p, _i64, _p, _p, _p, _p, _p, _i64,
    ]
    library.tiergate_decode_forward_f32.restype = ctypes.c_int
    library.tiergate_decode_workspace_floats.argtypes = [_p]
    library.tiergate_decode_workspace_floats.restype = _i64
    library.tiergate_panel_product.argtypes = [_p, _i64, _i64, _p, _p, _i64, _p, _i64]
    library.tiergate_panel_product.restype = ctypes.c_int
    library.tiergate_panel_rows.argtypes = [_p, _i64, _i64, _p, _i64, _p]
    library.tiergate_panel_rows.restype = ctypes.c_int
    library.tiergate_lora_update_f32.argtypes = [_p, _i64, _i64, _i64, _p, _i64, _p, _i64, _i64,
                                                 _i64]
    library.tiergate_lora_update_f32.restype = ctypes.c_int
    library.tiergate_int8_rows.argtypes = [_i64]
    library.tiergate_int8_rows.restype = _i64
    return library


def int8_activation_rows(fmt: PanelFormat) -> int | None:
    """Rows above which a product over quantized panels of `fmt` rounds its activations to
    int8 per block of 32 (cpu_decode.cpp: the dequantized weights times the rounded
    activations), or None where it never does (float32 panels, a CPU without AVX2) or the
    library is not built."""
    library = _library()
    rows = 0 if library is None else int(library.tiergate_int8_rows(int(fmt)))
    return rows or None


@functools.cache
def _agrees_with_layers() -> bool:
    """The kernel on a tiny random model against that model's layers in plain torch, adapters
    included (catches a miscompiled library before it serves)."""
    from engine.attention.torch_paged import TorchPagedAttention
    from engine.models.loader import random_model

    model = random_model(ModelConfig.from_dict(_CHECK_CONFIG), seed=0, max_model_len=64)
    config, block_size = model.config, 4
    generator = torch.Generator().manual_seed(0)
    shape = (3 * _CHECK_ROWS, block_size, config.num_kv_heads, config.head_dim)
    caches = [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
              for _ in range(config.num_layers)]
    contexts = torch.arange(2, 2 + _CHECK_ROWS, dtype=torch.int32)  # tokens after the step
    tables = torch.randperm(3 * _CHECK_ROWS, generator=generator).to(torch.int32).view(-1, 3)
    positions = contexts.to(torch.int64) - 1
    blocks = tables.gather(1, (positions // block_size).view(-1, 1)).view(-1).to(torch.int64)
    batch = ForwardBatch(
        input_ids=torch.randint(0, config.vocab_size, (_CHECK_ROWS,), generator=generator),
        positions=positions,
        slot_mapping=blocks * block_size + positions % block_size,
        block_tables=tables,
        query_start_loc=torch.arange(_CHECK_ROWS + 1, dtype=torch.int32),
        context_lens=contexts,
        logits_indices=torch.arange(_CHECK_ROWS),
    )
    shapes = target_shapes(config)
    library = _library()
    assert library is not None
    reference = LoraSlots(len(_CHECK_ADAPTERS), torch.device("cpu"))  # torch's products
    kernels = LoraSlots(len(_CHECK_ADAPTERS), torch.device("cpu"),
                        CpuLoraKernels(config, len(_CHECK_ADAPTERS), library))
    for slot, (rank, targets) in enumerate(_CHECK_ADAPTERS):
        layers = [{name: (torch.randn(rank, shapes[name][0], generator=generator) / 4,
                          torch.randn(shapes[name][1], rank, generator=generator) / 4)
                   for name in targets} for _ in range(config.num_layers)]
        weights = LoraWeights.fuse(layers, {name: out for name, (_, out) in shapes.items()},
                                   torch.float32, torch.device("cpu"))
        reference.set_slot(slot, weights)
        kernels.set_slot(slot, weights)
    attention = TorchPagedAttention()
    attention.prepare(batch.attention_metadata())
    logits = []
    with torch.inference_mode():
        for slots in (reference, kernels):  # the layers: with torch's LoRA products, the C++
            slots.bind(np.array(_CHECK_ROW_SLOTS, dtype=np.int64))
            model.use_lora_slots(slots)
            logits.append(model(batch, [(k.clone(), v.clone()) for k, v in caches], attention))
        logits.append(CpuDecodeForward(model, caches, _CHECK_ROWS)(batch, kernels))
    expected = logits[0]
    if all(bool((got - expected).norm() / expected.norm() < _CHECK_TOLERANCE)
           for got in logits[1:]):
        return True
    logger.warning("the CPU decode forward or LoRA kernels disagree with the layers; the "
                   "layers and torch's products keep the steps")
    return False


def supports(config: ModelConfig, device: torch.device, dtype: torch.dtype) -> bool:
    """Whether a model of this config, device and dtype can take the decode forward (builds
    it): what the fused row ops and the attention kernel take, every matrix in whole panels."""
    sizes = (config.hidden_size, config.intermediate_size, config.q_size, config.kv_size,
             config.vocab_size)
    return (
        cpu_ops.supports(config, device, dtype)
        and cpu_kernel.supports_head_dim(config.head_dim)
        and cpu_kernel.load() is not None
        and all(size % _PANEL == 0 for size in sizes)
        and _library() is not None
        and _agrees_with_layers()
    )


def lora_kernels(config: ModelConfig, num_slots: int) -> CpuLoraKernels:
    """The CPU kernels of num_slots adapter slots (supports() must be true): the decode
    forward's, and the layer path's LoRA updates."""
    library = _library()
    assert library is not None, "supports() must be true before CPU LoRA kernels are made"
    return CpuLoraKernels(config, num_slots, library)


def interleaved_panels(weight: torch.Tensor) -> PanelMatrix:  # [2I, K]
    """gate (the first I rows) and up (the rest) in float panels, gate 0, up 0, gate 1, ..."""
    gate, up = weight.detach().chunk(2, dim=0)
    pairs = interleave_panels(float_panels(gate), float_panels(up))
    assert pairs is not None
    return pairs


def _interleaved_bias(bias: torch.Tensor) -> torch.Tensor:  # [2I] -> [2I] in panel order
    gate, up = bias.detach().chunk(2)
    return torch.stack([gate.reshape(-1, _PANEL), up.reshape(-1, _PANEL)], dim=1).reshape(-1)


class CpuDecodeForward:
    """The forward of decode-only steps of at most max_rows sequences, as one C++ call."""

    def __init__(self, model: CausalLM, kv_caches: list[KVCache], max_rows: int = MAX_ROWS,
                 ) -> None:
        """Packs the weights now: call before the model's linear layers are replaced by packed
        ones (engine.models.packed_linear), which drop the plain weights. Layers already over
        panels (`PanelLinear`, `PanelEmbedding`: a GGUF file's blocks as stored) are read in
        place, not copied."""
        library = _library()
        assert library is not None, "supports() must be true before a CpuDecodeForward is made"
        assert model.rotary is not None, "the model's rotary table is built at load"
        if not 1 <= max_rows <= MAX_ROWS:
            raise ValueError(f"max_rows must be 1..{MAX_ROWS}")
        self._library = library
        self.max_rows = max_rows
        config = model.config
        self.vocab_size = config.vocab_size
        keep: list[torch.Tensor] = []  # what the C++ side points into
        copies: list[PanelMatrix] = []  # panels made here: this forward's cost

        def pointer(tensor: torch.Tensor | None) -> int | None:
            if tensor is None:
                return None
            tensor = tensor.detach().contiguous()
            keep.append(tensor)
            return tensor.data_ptr()

        def matrix(module: nn.Module, interleaved: bool = False) -> _Matrix:
            if isinstance(module, PanelLinear):
                return module.matrix  # kept by the module: a stack's parts chain from it
            weight = cast(nn.Linear, module).weight
            panels = interleaved_panels(weight) if interleaved else float_panels(weight)
            copies.append(panels)
            return _Matrix.of(panels)

        def bias(module: nn.Module, interleaved: bool = False) -> int | None:
            value = cast(torch.Tensor | None, getattr(module, "bias", None))
            return pointer(None if value is None
                           else _interleaved_bias(value) if interleaved else value)

        lm_head = matrix(model.lm_head)
        if isinstance(model.lm_head, PanelLinear):
            self.lm_head_panels = model.lm_head.panels
        else:
            self.lm_head_panels = copies[0]
        embedding = model.embed_tokens
        embed_panels = _Matrix.of(embedding.panels) if isinstance(embedding, PanelEmbedding) \
            else _Matrix(None, int(PanelFormat.F32))

        decoder_layers = [cast(DecoderLayer, layer) for layer in model.layers]
        layers = (_Layer * config.num_layers)()
        for index, (layer, (k_cache, v_cache)) in enumerate(
            zip(decoder_layers, kv_caches, strict=True)
        ):
            attention, mlp = layer.self_attn, layer.mlp
            layers[index] = _Layer(
                input_norm=pointer(layer.input_layernorm.weight),
                q_norm=pointer(None if attention.q_norm is None else attention.q_norm.weight),
                k_norm=pointer(None if attention.k_norm is None else attention.k_norm.weight),
                qkv=matrix(attention.qkv_proj),
                qkv_bias=bias(attention.qkv_proj),
                o=matrix(attention.o_proj),
                o_bias=bias(attention.o_proj),
                post_norm=pointer(layer.post_attention_layernorm.weight),
                gate_up=matrix(mlp.gate_up_proj, interleaved=True),
                gate_up_bias=bias(mlp.gate_up_proj, interleaved=True),
                down=matrix(mlp.down_proj),
                down_bias=bias(mlp.down_proj),
                k_cache=pointer(k_cache),
                v_cache=pointer(v_cache),
                window=attention.sliding_window or 0,
            )
        first_cache = kv_caches[0][0]
        self._layers = layers
        self._model = _Model(
            num_layers=config.num_layers, hidden=config.hidden_size, num_heads=config.num_heads,
            num_kv_heads=config.num_kv_heads, head_dim=config.head_dim,
            intermediate=config.intermediate_size, vocab=config.vocab_size,
            block_size=first_cache.shape[1], num_blocks=first_cache.shape[0],
            max_positions=model.rotary.cos.shape[0], max_rows=max_rows,
            eps=config.rms_norm_eps, scale=decoder_layers[0].self_attn.scale,
            embed=None if isinstance(embedding, PanelEmbedding)
            else pointer(cast(nn.Embedding, embedding).weight),
            embed_panels=embed_panels, final_norm=pointer(model.norm.weight),
            lm_head=lm_head,
            cos_table=pointer(model.rotary.cos), sin_table=pointer(model.rotary.sin),
            layers=ctypes.addressof(layers),
        )
        self._keep = keep
        self._panels = copies
        self.nbytes = sum(panels.nbytes for panels in copies)  # bytes of the panels made here
        floats = library.tiergate_decode_workspace_floats(ctypes.byref(self._model))
        self._workspace = torch.empty(floats, dtype=torch.float32)

    def lm_head_module(self) -> PanelLinear:
        """The lm_head as a module over this forward's panels (for the layer path)."""
        return PanelLinear(self.lm_head_panels)  # the same panels, when it already was one

    def can_run(self, batch: ForwardBatch, lora: LoraSlots | None = None) -> bool:
        """A decode-only step of at most max_rows sequences, every row sampled; lora: the
        adapters bound to the step (in CpuLoraKernels), or None when no row is on one."""
        num_tokens = batch.num_tokens
        return (
            num_tokens <= self.max_rows
            and num_tokens == batch.num_seqs
            and batch.logits_indices.shape[0] == num_tokens
            and (lora is None or (isinstance(lora.kernels, CpuLoraKernels)
                                  and lora.token_slots is not None
                                  and len(lora.token_slots) == num_tokens))
        )

    def __call__(self, batch: ForwardBatch, lora: LoraSlots | None = None,
                 ) -> torch.Tensor:  # float32[T, V]
        """Runs the step (can_run must hold): writes the new K/V, returns every row's logits;
        lora: the step's adapters (each row's slot bound), None: every row on the base model.
        The kernel checks every input against the model and the cache before it runs."""
        num_rows = batch.num_tokens
        ids, positions, slots, tables, lens, starts = (t.contiguous() for t in (
            batch.input_ids, batch.positions, batch.slot_mapping, batch.block_tables,
            batch.context_lens, batch.query_start_loc,
        ))  # ForwardBatch's dtypes: int64 token rows, int32 layout
        adapters = None if lora is None else ctypes.byref(
            cast(ctypes.Structure, lora.kernel_plan()))
        logits = torch.empty(num_rows, self.vocab_size, dtype=torch.float32)
        status = self._library.tiergate_decode_forward_f32(
            ctypes.byref(self._model), num_rows, ids.data_ptr(), positions.data_ptr(),
            slots.data_ptr(), tables.data_ptr(), tables.stride(0), lens.data_ptr(),
            starts.data_ptr(), adapters, self._workspace.data_ptr(), logits.data_ptr(),
            torch.get_num_threads(),
        )
        if status != 0:
            raise ValueError("decode step out of range: a token id, position, cache slot, block "
                             "table or adapter slot points outside the model, the cache or the "
                             "adapters")
        return logits


class _PanelModule(nn.Module):
    """A module over a matrix in panels, computed by cpu_decode.cpp (supports() true)."""

    def __init__(self, panels: PanelMatrix) -> None:
        super().__init__()
        library = _library()
        assert library is not None, "supports() must be true before a panel module is made"
        self._library = library
        self.panels = panels
        self.matrix = _Matrix.of(panels)  # what the kernels read


class PanelLinear(_PanelModule):
    """y = x W^T + b over a weight in panels, float32 or quantized: the lm_head of the steps
    that go layer by layer, sharing the decode forward's copy
    (CpuDecodeForward.lm_head_module), so the lm_head needs no oneDNN-packed copy as well;
    and every projection of a model served from a GGUF file's blocks as stored, whose panels
    the decode forward reads too. interleaved: panels of gate and up interleaved (the decode
    forward's gate_up), the output put back in the layers' order, gate then up; the bias is
    in that order."""

    def __init__(self, panels: PanelMatrix, bias: torch.Tensor | None = None,
                 interleaved: bool = False) -> None:
        super().__init__(panels)
        self.bias = bias
        self.interleaved = interleaved
        self.out_features = panels.out_features
        self.in_features = panels.in_features

    def forward(self, x: torch.Tensor) -> torch.Tensor:  # float32 [..., K] -> [..., N]
        rows = x.reshape(-1, self.in_features).contiguous()
        out = rows.new_empty((rows.shape[0], self.out_features))
        bias = None if self.bias is None or self.interleaved else self.bias.data_ptr()
        status = self._library.tiergate_panel_product(
            rows.data_ptr(), rows.shape[0], self.in_features, ctypes.byref(self.matrix), bias,
            self.out_features, out.data_ptr(), torch.get_num_threads(),
        )
        assert status == 0, "a panel format the library does not know"
        if self.interleaved:  # panels gate 0, up 0, gate 1, ... -> gate, then up
            out = out.view(-1, self.out_features // (2 * _PANEL), 2, _PANEL).transpose(1, 2)
            out = out.reshape(-1, self.out_features)
            if self.bias is not None:
                out += self.bias
        return out.view(*x.shape[:-1], self.out_features)


class PanelEmbedding(_PanelModule):
    """Embedding lookups in a matrix [V, E] held in panels (a GGUF file's token embedding,
    quantized; tied or not to the lm_head): each row dequantized as it is looked up."""

    def __init__(self, panels: PanelMatrix) -> None:
        super().__init__(panels)
        self.num_embeddings = panels.out_features
        self.embedding_dim = panels.in_features

    def forward(self, ids: torch.Tensor) -> torch.Tensor:  # int64 [...] -> float32 [..., E]
        flat = ids.reshape(-1).to(torch.int64).contiguous()
        out = torch.empty(flat.shape[0], self.embedding_dim, dtype=torch.float32)
        status = self._library.tiergate_panel_rows(
            ctypes.byref(self.matrix), self.num_embeddings, self.embedding_dim, flat.data_ptr(),
            flat.shape[0], out.data_ptr())
        if status != 0:
            raise ValueError("a token id outside the embedding")
        return out.view(*ids.shape, self.embedding_dim)
