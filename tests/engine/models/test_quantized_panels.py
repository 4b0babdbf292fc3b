"""Quantized panels (engine.models.quantized_panels) against gguf's own dequantization: the
repacking, the C++ products over them (every row-count path), and the decode forward of a
tiny model whose matrices are held as GGUF blocks."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine.attention.torch_paged import TorchPagedAttention
from engine.models import cpu_decode
from engine.models.batch import ForwardBatch
from engine.models.config import ModelConfig
from engine.models.loader import random_model
from engine.models.quantized_panels import (
    PANEL_TYPES,
    PanelFormat,
    PanelMatrix,
    float_panels,
    gguf_panels,
    interleave_panels,
    stack_panels,
)

T = GGMLQuantizationType
_SCALES = {T.Q8_0: 1, T.Q4_0: 1, T.Q4_1: 2, T.Q4_K: 2}  # float16 fields leading each block


def random_blocks(kind: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Raw blocks of random values (every bit pattern a valid one) and small float16 scales."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    fields = _SCALES[kind]
    scales = rng.uniform(0.001, 0.05, size=(rows, cols // block, fields)).astype(np.float16)
    if kind == T.Q4_1:
        scales[..., 1] *= -8  # the minimum
    raw[..., :2 * fields] = scales.view(np.uint8).reshape(rows, cols // block, 2 * fields)
    return raw.reshape(rows, -1)


def reference(raw: np.ndarray, kind: GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw, kind).reshape(raw.shape[0], -1).astype(np.float32))


def panels_in_numpy(matrix: PanelMatrix) -> np.ndarray:
    """The panels' weights [N, K], read back in numpy from the layout the kernel reads."""
    data = matrix.data.numpy()
    panels, blocks = data.shape[:2]
    scale = data[..., :64].copy().view(np.float32)  # [P, B, 16]
    if matrix.format is PanelFormat.Q8:
        values = data[..., 64:].copy().view(np.int8).reshape(panels, blocks, 32, 16)
        weights = values * scale[:, :, None, :]
    else:
        low = data[..., 64:128].copy().view(np.float32)
        nibbles = data[..., 128:].reshape(panels, blocks, 16, 16)
        values = np.concatenate([nibbles & 15, nibbles >> 4], axis=2)
        weights = values * scale[:, :, None, :] + low[:, :, None, :]
    return weights.transpose(0, 3, 1, 2).reshape(panels * 16, blocks * 32)


@pytest.mark.parametrize("kind", sorted(PANEL_TYPES, key=int))
def test_repacked_blocks_hold_gguf_weights(kind: GGMLQuantizationType) -> None:
    raw = random_blocks(kind, 48, 512, seed=int(kind))
    matrix = gguf_panels(raw, kind, 48, 512)
    assert matrix.format is PANEL_TYPES[kind]
    expected = reference(raw, kind).numpy()
    np.testing.assert_allclose(panels_in_numpy(matrix), expected, rtol=1e-6, atol=1e-7)
    # The panels' size against the blocks': what serving the file as stored costs.
    assert matrix.nbytes <= 1.34 * raw.nbytes


@pytest.mark.parametrize("kind", sorted(PANEL_TYPES, key=int))
@pytest.mark.parametrize("num_rows", [1, 3, 8, 19])  # register paths; 19: blocks and a tail
def test_products_over_blocks_equal_the_dequantized_product(
    kind: GGMLQuantizationType, num_rows: int,
) -> None:
    raw = random_blocks(kind, 80, 512, seed=num_rows)
    generator = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, 512, generator=generator)
    got = cpu_decode.PanelLinear(gguf_panels(raw, kind, 80, 512))(x)
    expected = x @ reference(raw, kind).T
    assert float((got - expected).norm() / expected.norm()) < 1e-5


def test_unsupported_blocks_and_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="no quantized panels for Q6_K"):
        gguf_panels(np.zeros((16, 210), dtype=np.uint8), T.Q6_K, 16, 256)
    with pytest.raises(ValueError, match="does not cut into panels"):
        gguf_panels(random_blocks(T.Q8_0, 24, 64, seed=0), T.Q8_0, 24, 64)
    q8, q4 = (gguf_panels(random_blocks(kind, 16, 64, seed=1), kind, 16, 64)
              for kind in (T.Q8_0, T.Q4_1))
    assert stack_panels([q8, q4]) is None and interleave_panels(q8, q4) is None
    assert stack_panels([q8, q8]) is not None


def _quantized_model(kind: GGMLQuantizationType) -> tuple[torch.nn.Module, dict[str, PanelMatrix]]:
    """The load-time check's tiny Llama with every matrix quantized to `kind` (the lm_head to
    Q8_0): its float weights set to the blocks dequantized, the blocks in panels by name."""
    model = random_model(ModelConfig.from_dict(cpu_decode._CHECK_CONFIG), seed=0,
                         max_model_len=64)
    found: dict[str, PanelMatrix] = {}

    def as_blocks(weight: torch.Tensor, use: GGMLQuantizationType) -> PanelMatrix:
        raw = quantize(weight.detach().numpy(), use)
        weight.data.copy_(reference(raw, use))
        return gguf_panels(raw, use, *weight.shape)

    found["lm_head"] = as_blocks(model.lm_head.weight, T.Q8_0)
    for index, layer in enumerate(model.layers):
        prefix = f"layers.{index}."
        attention, mlp = layer.self_attn, layer.mlp
        found[prefix + "self_attn.qkv_proj"] = as_blocks(attention.qkv_proj.weight, kind)
        found[prefix + "self_attn.o_proj"] = as_blocks(attention.o_proj.weight, kind)
        gate, up = mlp.gate_up_proj.weight.data.chunk(2)
        pairs = interleave_panels(as_blocks(gate, kind), as_blocks(up, kind))
        assert pairs is not None
        found[prefix + "mlp.gate_up_proj"] = pairs
        found[prefix + "mlp.down_proj"] = as_blocks(mlp.down_proj.weight, kind)
    return model, found


@pytest.mark.parametrize("kind", [T.Q8_0, T.Q4_0, T.Q4_1])
def test_decode_forward_over_blocks_matches_the_layers(kind: GGMLQuantizationType) -> None:
    """Nine rows (a block of 8 and one) through the forward over quantized panels, against
    the model's own layers in torch over the same blocks dequantized."""
    model, found = _quantized_model(kind)
    config, rows, block_size = model.config, 9, 4
    generator = torch.Generator().manual_seed(int(kind))
    shape = (3 * rows, block_size, config.num_kv_heads, config.head_dim)
    caches = [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
              for _ in range(config.num_layers)]
    contexts = torch.arange(2, 2 + rows, dtype=torch.int32)
    tables = torch.randperm(3 * rows, generator=generator).to(torch.int32).view(-1, 3)
    positions = contexts.to(torch.int64) - 1
    blocks = tables.gather(1, (positions // block_size).view(-1, 1)).view(-1).to(torch.int64)
    batch = ForwardBatch(
        input_ids=torch.randint(0, config.vocab_size, (rows,), generator=generator),
        positions=positions, slot_mapping=blocks * block_size + positions % block_size,
        block_tables=tables, query_start_loc=torch.arange(rows + 1, dtype=torch.int32),
        context_lens=contexts, logits_indices=torch.arange(rows),
    )
    attention = TorchPagedAttention()
    attention.prepare(batch.attention_metadata())
    forward = cpu_decode.CpuDecodeForward(model, [(k.clone(), v.clone()) for k, v in caches],
                                          rows, quantized=found)
    assert forward.nbytes == sum(matrix.nbytes for matrix in found.values())
    with torch.inference_mode():
        expected = model(batch, caches, attention)
        got = forward(batch)
    assert float((got - expected).norm() / expected.norm()) < 1e-4


def test_decode_forward_refuses_matrices_that_do_not_fit() -> None:
    model, found = _quantized_model(T.Q4_1)
    config = model.config
    shape = (4, 4, config.num_kv_heads, config.head_dim)
    caches = [(torch.zeros(shape), torch.zeros(shape)) for _ in range(config.num_layers)]
    with pytest.raises(ValueError, match=r"quantized matrices of no module: layers\.9\.mlp"):
        cpu_decode.CpuDecodeForward(model, caches, 1, quantized={
            **found, "layers.9.mlp.down_proj": found["layers.0.mlp.down_proj"]})
    with pytest.raises(ValueError, match=r"layers\.0\.self_attn\.o_proj: panels of"):
        cpu_decode.CpuDecodeForward(model, caches, 1, quantized={
            **found, "layers.0.self_attn.o_proj": found["layers.0.self_attn.qkv_proj"]})
    float_only = cpu_decode.CpuDecodeForward(model, caches, 1)
    assert float_only.lm_head_panels.format is PanelFormat.F32
    assert torch.equal(float_only.lm_head_panels.data,
                       float_panels(model.lm_head.weight).data)
