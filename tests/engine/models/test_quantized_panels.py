"""Quantized panels (engine.models.quantized.panels) against gguf's own dequantization: the
repacking, the C++ products over them (every row-count path; above `int8_activation_rows`,
against the dequantized weights times the activations rounded as the kernels round them),
and the decode forward of a tiny model whose matrices are held as GGUF blocks."""

from __future__ import annotations

import copy
from typing import cast

import numpy as np
import pytest
import torch
from gguf import GGML_QUANT_SIZES, GGMLQuantizationType
from gguf.quants import dequantize, quantize

from engine.attention.torch_paged import TorchPagedAttention
from engine.models import cpu_decode
from engine.models.batch import ForwardBatch
from engine.models.config import ModelConfig
from engine.models.decoder import CausalLM
from engine.models.loader import random_model
from engine.models.quantized.panels import (
    PANEL_TYPES,
    PanelFormat,
    PanelMatrix,
    gguf_panels,
    interleave_panels,
    stack_panels,
)
from tests.engine.models.int8_rounding import product_input, rounded_activations, rounded_like

T = GGMLQuantizationType
# Each block's float16 fields: (byte offset, how many); the minimum is the second of Q4_1 and
# Q5_1's.
_SCALES = {T.Q8_0: (0, 1), T.Q4_0: (0, 1), T.Q4_1: (0, 2), T.Q4_K: (0, 2), T.Q5_0: (0, 1),
           T.Q5_1: (0, 2), T.Q5_K: (0, 2), T.Q6_K: (208, 1)}


def random_blocks(kind: GGMLQuantizationType, rows: int, cols: int, seed: int) -> np.ndarray:
    """Raw blocks of random values (every bit pattern a valid one) and small float16 scales."""
    rng = np.random.default_rng(seed)
    block, size = GGML_QUANT_SIZES[kind]
    raw = rng.integers(0, 256, size=(rows, cols // block, size), dtype=np.uint8)
    offset, fields = _SCALES[kind]
    scales = rng.uniform(0.001, 0.05, size=(rows, cols // block, fields))
    if kind in (T.Q4_1, T.Q5_1):
        scales[..., 1] *= -(8 if kind == T.Q4_1 else 16)  # the minimum
    raw[..., offset:offset + 2 * fields] = scales.astype(np.float16).view(np.uint8).reshape(
        rows, cols // block, 2 * fields)
    return raw.reshape(rows, -1)


def reference(raw: np.ndarray, kind: GGMLQuantizationType) -> torch.Tensor:
    return torch.from_numpy(dequantize(raw, kind).reshape(raw.shape[0], -1).astype(np.float32))


def panels_in_numpy(matrix: PanelMatrix) -> np.ndarray:
    """The panels' weights [N, K], read back in numpy from the layout the kernel reads."""
    data = matrix.data.numpy()
    panels, blocks = data.shape[:2]

    def halves(start: int) -> np.ndarray:  # 16 float16 at byte `start` of each block
        return data[..., start:start + 32].copy().view(np.float16).astype(np.float32)

    def words(start: int, count: int) -> np.ndarray:  # count little-endian uint32 at `start`
        return data[..., start:start + 4 * count].copy().view("<u4").astype(np.int64)

    fmt = matrix.format
    lanes = np.arange(16)
    scale = halves(0)[:, :, None, :]  # [P, B, input, 16]
    if fmt is PanelFormat.Q8:
        values = data[..., 32:].copy().view(np.int8).reshape(panels, blocks, 32, 16)
        weights = values * scale
    else:
        if fmt in (PanelFormat.Q4_K, PanelFormat.Q5_K):
            scale = scale * data[..., None, 64:80].astype(np.float32)
            low = -(halves(32) * data[..., 80:96].astype(np.float32))[:, :, None, :]
            start = 96
        elif fmt is PanelFormat.Q6_K:
            factors = data[..., 32:64].copy().view(np.int8).reshape(panels, blocks, 2, 1, 16)
            scale = np.broadcast_to(scale[:, :, None] * factors, (panels, blocks, 2, 16, 16))
            scale = scale.reshape(panels, blocks, 32, 16)
            low = -32 * scale
            start = 64
        else:
            low = halves(32)[:, :, None, :]
            start = 64
        if fmt in (PanelFormat.Q5, PanelFormat.Q5_K):
            high = words(start, 16)[..., None]  # [P, B, 16, 1]
            fifth = np.concatenate([(high >> lanes) & 1, (high >> (lanes + 16)) & 1], axis=2)
            start += 64
        elif fmt is PanelFormat.Q6_K:
            fifth = (words(start, 32)[..., None] >> (2 * lanes)) & 3
            start += 128
        else:
            fifth = np.zeros((panels, blocks, 32, 16), dtype=np.int64)
        nibbles = data[..., start:].reshape(panels, blocks, 16, 16)
        values = np.concatenate([nibbles & 15, nibbles >> 4], axis=2) | (fifth << 4)
        weights = values * scale + low
    return weights.transpose(0, 3, 1, 2).reshape(panels * 16, blocks * 32)


@pytest.mark.parametrize("kind", sorted(PANEL_TYPES, key=int))
def test_repacked_blocks_hold_gguf_weights(kind: GGMLQuantizationType) -> None:
    raw = random_blocks(kind, 48, 512, seed=int(kind))
    matrix = gguf_panels(raw, kind, 48, 512)
    assert matrix.format is PANEL_TYPES[kind]
    expected = reference(raw, kind).numpy()
    np.testing.assert_allclose(panels_in_numpy(matrix), expected, rtol=1e-6, atol=1e-7)
    # The panels' size against the blocks': what serving the file as stored costs.
    ratio = {T.Q8_0: 1.0, T.Q4_0: 20 / 18, T.Q4_1: 1.0, T.Q4_K: 352 / 288, T.Q5_0: 24 / 22,
             T.Q5_1: 1.0, T.Q5_K: 416 / 352, T.Q6_K: 448 / 420}[kind]
    assert matrix.nbytes == pytest.approx(ratio * raw.nbytes)


@pytest.mark.parametrize(("kind", "layout"), [(T.Q4_0, PanelFormat.Q4_K),
                                              (T.Q5_0, PanelFormat.Q5_K)])
def test_minimums_past_float16_take_the_k_quant_layout(kind: GGMLQuantizationType,
                                                       layout: PanelFormat) -> None:
    raw = random_blocks(kind, 16, 64, seed=5)
    size = GGML_QUANT_SIZES[kind][1]
    raw.reshape(16, 2, size)[0, 0, :2] = np.array([10000.0], dtype=np.float16).view(np.uint8)
    matrix = gguf_panels(raw, kind, 16, 64)  # -8 (-16) x 10000 is past float16's 65504
    assert matrix.format is layout
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    expected = product_input(x, matrix) @ reference(raw, kind).T
    got = cpu_decode.PanelLinear(matrix)(x)
    assert float((got - expected).norm() / expected.norm()) < 1e-5
    np.testing.assert_allclose(panels_in_numpy(matrix), reference(raw, kind).numpy(),
                               rtol=1e-6)


@pytest.mark.parametrize("kind", sorted(PANEL_TYPES, key=int))
@pytest.mark.parametrize("num_rows", [1, 2, 3, 8, 9, 19])  # float at 1-2, int8 above; tails
def test_products_over_blocks_equal_the_dequantized_product(
    kind: GGMLQuantizationType, num_rows: int,
) -> None:
    raw = random_blocks(kind, 80, 512, seed=num_rows)
    generator = torch.Generator().manual_seed(num_rows)
    x = torch.randn(num_rows, 512, generator=generator)
    matrix = gguf_panels(raw, kind, 80, 512)
    got = cpu_decode.PanelLinear(matrix)(x)
    expected = product_input(x, matrix) @ reference(raw, kind).T
    assert float((got - expected).norm() / expected.norm()) < 1e-5
    if product_input(x, matrix) is not x:  # int8 activations: within rounding of float ones
        exact = x @ reference(raw, kind).T
        assert 1e-4 < float((got - exact).norm() / exact.norm()) < 2e-2


@pytest.mark.parametrize("kind", sorted(PANEL_TYPES, key=int))
def test_int8_products_hold_the_largest_sums(kind: GGMLQuantizationType) -> None:
    """Every value at its format's largest (all bits set; Q8_0: 127, then -128) against
    activations that round to 127 everywhere: the byte products' largest sums, which 16-bit
    partial sums without VNNI must hold without saturating."""
    for fill in (0x7F, 0x80) if kind == T.Q8_0 else (0xFF,):
        raw = random_blocks(kind, 32, 256, seed=1)
        block, size = GGML_QUANT_SIZES[kind]
        blocks = raw.reshape(32, 256 // block, size)
        offset, fields = _SCALES[kind]
        keep = blocks[..., offset:offset + 2 * fields].copy()
        blocks[...] = fill
        blocks[..., offset:offset + 2 * fields] = keep
        matrix = gguf_panels(raw, kind, 32, 256)
        x = torch.ones(12, 256)
        expected = product_input(x, matrix) @ reference(raw, kind).T
        got = cpu_decode.PanelLinear(matrix)(x)
        assert float((got - expected).norm() / expected.norm()) < 1e-5, fill


def test_activations_round_per_block_of_32() -> None:
    x = torch.tensor([[0.0] * 32 + [1.27, -0.635, 0.0051, 0.0049] + [0.0] * 28])
    got = rounded_activations(x)
    assert torch.equal(got[0, :32], torch.zeros(32))  # an all-zero block stays zero
    torch.testing.assert_close(got[0, 32:36], torch.tensor([1.27, -0.64, 0.01, 0.0]))


def test_unsupported_blocks_and_shapes_are_refused() -> None:
    with pytest.raises(ValueError, match="no quantized panels for Q3_K"):
        gguf_panels(np.zeros((16, 110), dtype=np.uint8), T.Q3_K, 16, 256)
    with pytest.raises(ValueError, match="does not cut into panels"):
        gguf_panels(random_blocks(T.Q8_0, 24, 64, seed=0), T.Q8_0, 24, 64)
    q8, q4 = (gguf_panels(random_blocks(kind, 16, 64, seed=1), kind, 16, 64)
              for kind in (T.Q8_0, T.Q4_1))
    assert interleave_panels(q8, q4) is None  # gate and up of one format only
    wide = gguf_panels(random_blocks(T.Q8_0, 16, 96, seed=1), T.Q8_0, 16, 96)
    assert stack_panels([q8, wide]) is None
    assert not cast(PanelMatrix, stack_panels([q8, q8])).parts


def test_a_stack_of_formats_is_taken_part_by_part() -> None:
    """q and k in Q4_K, v in Q6_K (a Q4_K_M file's qkv in some layers): the stack keeps two
    parts, and products over it equal the dequantized product at every row-count path."""
    kinds = (T.Q4_K, T.Q4_K, T.Q6_K)
    raws = [random_blocks(kind, rows, 512, seed=rows) for kind, rows in zip(kinds, (64, 32, 32),
                                                                            strict=True)]
    stack = stack_panels([gguf_panels(raw, kind, raw.shape[0], 512)
                          for raw, kind in zip(raws, kinds, strict=True)])
    assert stack is not None and stack.origin == "Q4_K+Q6_K" and stack.out_features == 128
    assert [(part.format, part.out_features) for part in stack.parts] == [
        (PanelFormat.Q4_K, 96), (PanelFormat.Q6_K, 32)]
    assert stack.nbytes == sum(part.data.nbytes for part in stack.parts)
    linear = cpu_decode.PanelLinear(stack)
    for num_rows in (1, 3, 8, 19):
        x = torch.randn(num_rows, 512, generator=torch.Generator().manual_seed(num_rows))
        expected = torch.cat([product_input(x, part) @ weights.T for part, weights in zip(
            stack.parts, (torch.cat([reference(raw, T.Q4_K) for raw in raws[:2]]),
                          reference(raws[2], T.Q6_K)), strict=True)], dim=1)
        assert float((linear(x) - expected).norm() / expected.norm()) < 1e-5


def _quantized_models(kind: GGMLQuantizationType,
                      v_kind: GGMLQuantizationType | None = None) -> tuple[CausalLM, CausalLM]:
    """The load-time check's tiny Llama (biases everywhere, lm_head untied) with every matrix
    quantized to `kind`, the embedding and lm_head to Q8_0: (float, stored), the first with
    the blocks dequantized into its weights, the second over the blocks in panels
    (PanelLinear, PanelEmbedding), as engine.checkpoints.gguf_panels builds it."""
    model = random_model(ModelConfig.from_dict(cpu_decode._CHECK_CONFIG), seed=0,
                         max_model_len=64)
    stored = copy.deepcopy(model)

    def as_blocks(weight: torch.Tensor, use: GGMLQuantizationType) -> PanelMatrix:
        raw = quantize(weight.detach().numpy(), use)
        weight.data.copy_(reference(raw, use))
        return gguf_panels(raw, use, *weight.shape)

    def bias(module: torch.nn.Module) -> torch.Tensor | None:
        value = getattr(module, "bias", None)
        return None if value is None else value.detach().clone()

    embedding = cast(torch.nn.Embedding, model.embed_tokens)
    stored.embed_tokens = cpu_decode.PanelEmbedding(as_blocks(embedding.weight, T.Q8_0))
    lm_head = cast(torch.nn.Linear, model.lm_head)
    stored.lm_head = cpu_decode.PanelLinear(as_blocks(lm_head.weight, T.Q8_0))
    for layer, into in zip(model.layers, stored.layers, strict=True):
        attention, mlp = layer.self_attn, layer.mlp
        qkv = attention.qkv_proj
        q_size = attention.q_size + attention.kv_size  # q and k in `kind`, v in v_kind
        parts = [as_blocks(qkv.weight.data[:q_size], kind),
                 as_blocks(qkv.weight.data[q_size:], v_kind or kind)]
        stacked = stack_panels(parts)
        assert stacked is not None and bool(stacked.parts) == (v_kind not in (None, kind))
        into.self_attn.qkv_proj = cpu_decode.PanelLinear(stacked, bias(qkv))
        into.self_attn.o_proj = cpu_decode.PanelLinear(as_blocks(attention.o_proj.weight, kind),
                                                       bias(attention.o_proj))
        gate, up = mlp.gate_up_proj.weight.data.chunk(2)
        pairs = interleave_panels(as_blocks(gate, kind), as_blocks(up, kind))
        assert pairs is not None
        into.mlp.gate_up_proj = cpu_decode.PanelLinear(pairs, bias(mlp.gate_up_proj),
                                                       interleaved=True)
        into.mlp.down_proj = cpu_decode.PanelLinear(as_blocks(mlp.down_proj.weight, kind),
                                                    bias(mlp.down_proj))
    return model, stored


def _caches(config: ModelConfig, num_blocks: int, block_size: int,
            generator: torch.Generator) -> list[tuple[torch.Tensor, torch.Tensor]]:
    shape = (num_blocks, block_size, config.num_kv_heads, config.head_dim)
    return [(torch.randn(shape, generator=generator), torch.randn(shape, generator=generator))
            for _ in range(config.num_layers)]


def _layers(model: CausalLM, batch: ForwardBatch,
            caches: list[tuple[torch.Tensor, torch.Tensor]]) -> torch.Tensor:
    attention = TorchPagedAttention()
    attention.prepare(batch.attention_metadata())
    with torch.inference_mode():
        return model(batch, [(k.clone(), v.clone()) for k, v in caches], attention)


@pytest.mark.parametrize(("kind", "v_kind"), [(T.Q8_0, None), (T.Q4_0, None), (T.Q4_1, None),
                                              (T.Q5_0, None), (T.Q5_1, None), (T.Q4_1, T.Q8_0)])
def test_decode_forward_over_blocks_matches_the_layers(
    kind: GGMLQuantizationType, v_kind: GGMLQuantizationType | None,
) -> None:
    """Nine rows (int8 activations where the CPU has them) through the decode forward of the
    stored model, against the float model's own layers in torch over the same blocks
    dequantized, their inputs rounded as the kernels round them; v_kind: v's blocks in another
    type, qkv a stack of two formats."""
    model, stored = _quantized_models(kind, v_kind)
    config, rows, block_size = model.config, 9, 4
    generator = torch.Generator().manual_seed(int(kind))
    caches = _caches(config, 3 * rows, block_size, generator)
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
    forward = cpu_decode.CpuDecodeForward(stored, [(k.clone(), v.clone()) for k, v in caches],
                                          rows)
    assert forward.nbytes == 0  # every matrix read in place, none copied
    assert forward.lm_head_panels is cast(cpu_decode.PanelLinear, stored.lm_head).panels
    with rounded_like(model, stored):
        expected = _layers(model, batch, caches)
    with torch.inference_mode():
        got = forward(batch)
    assert float((got - expected).norm() / expected.norm()) < 1e-4


@pytest.mark.parametrize("kind", [T.Q8_0, T.Q4_1, T.Q5_1])
def test_layer_path_over_blocks_matches_the_float_layers(kind: GGMLQuantizationType) -> None:
    """A prefill of two prompts (28 tokens: int8 activations where the CPU has them) through
    the stored model's layers, against the float model's, their inputs rounded alike."""
    model, stored = _quantized_models(kind)
    config, block_size = model.config, 4
    generator = torch.Generator().manual_seed(7)
    caches = _caches(config, 8, block_size, generator)
    lengths = (5, 23)
    tables = torch.tensor([[0, 1, -1, -1, -1, -1], [2, 3, 4, 5, 6, 7]], dtype=torch.int32)
    positions = torch.cat([torch.arange(n) for n in lengths])
    blocks = torch.cat([tables[i, torch.arange(n) // block_size].to(torch.int64)
                        for i, n in enumerate(lengths)])
    batch = ForwardBatch(
        input_ids=torch.randint(0, config.vocab_size, (sum(lengths),), generator=generator),
        positions=positions, slot_mapping=blocks * block_size + positions % block_size,
        block_tables=tables.clamp(min=0),
        query_start_loc=torch.tensor([0, 5, 28], dtype=torch.int32),
        context_lens=torch.tensor(lengths, dtype=torch.int32),
        logits_indices=torch.tensor([4, 27]),
    )
    with rounded_like(model, stored):
        expected = _layers(model, batch, caches)
    got = _layers(stored, batch, caches)
    assert float((got - expected).norm() / expected.norm()) < 1e-4


def test_panel_embedding_looks_up_dequantized_rows() -> None:
    raw = random_blocks(T.Q4_1, 64, 96, seed=3)
    blocks = raw.reshape(64, 3, 20)  # scales the row lookup converts one by one: float16
    blocks[0, 0, :4] = np.array([3e-6, -0.5], dtype=np.float16).view(np.uint8)  # subnormal
    blocks[17, 1, :4] = np.array([-0.02, 0.0], dtype=np.float16).view(np.uint8)
    embedding = cpu_decode.PanelEmbedding(gguf_panels(raw, T.Q4_1, 64, 96))
    ids = torch.tensor([[0, 63], [17, 17]])
    torch.testing.assert_close(embedding(ids), reference(raw, T.Q4_1)[ids], rtol=1e-6,
                               atol=1e-7)
    with pytest.raises(ValueError, match="outside the embedding"):
        embedding(torch.tensor([64]))
