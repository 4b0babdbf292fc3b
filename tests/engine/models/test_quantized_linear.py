"""QuantizedLinear's layouts and kernels: each checkpoint format repacked equals the published
layout's own dequantization, and each Triton kernel (under the interpreter without CUDA)
equals the torch reference at decode and prefill row counts."""

from __future__ import annotations

import os

import torch

if not torch.cuda.is_available():
    # Must happen before triton decorates the kernels: @triton.jit reads it at import time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from engine.models.config import ModelConfigError, QuantizationConfigError
from engine.models.quantized import (
    QuantizedFormat,
    QuantizedLinear,
    WeightKind,
    dequantize_fp8,
    dequantize_int,
)
from engine.models.quantized.layouts import QuantizedTensors, from_awq, from_fp8, from_gptq
from engine.models.quantized.triton_matmul import fp8_matmul, int_matmul
from tests.engine.models.quantized_checkpoints import (
    awq_tensors,
    fp8_dequantized,
    fp8_tensors,
    gptq_tensors,
    quantize_groups,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_IN, NUM_OUT = 256, 96  # 96 outputs: a partial column block at every block width
ROWS = [1, 3, 40]  # decode rows, and a prefill over a partial row block


def _weight(seed: int) -> torch.Tensor:
    return torch.randn(NUM_OUT, NUM_IN, generator=torch.Generator().manual_seed(seed)) * 0.05


def _int_layout(method: str, bits: int, group_size: int, seed: int = 0,
                ) -> tuple[QuantizedTensors, torch.Tensor]:
    """The repacked tensors of a random matrix in method's layout, and the matrix as the
    quantizer's own integers and scales give it (float32 [N, K])."""
    quantized = quantize_groups(_weight(seed), bits, group_size)
    if method == "awq":
        t = awq_tensors(quantized)
        repacked = from_awq("p", t["qweight"], t["qzeros"], t["scales"], NUM_IN, NUM_OUT,
                            group_size)
    else:
        t = gptq_tensors(quantized, bits)
        repacked = from_gptq("p", t["qweight"], t["qzeros"], t["scales"], t["g_idx"], NUM_IN,
                             NUM_OUT, bits, group_size, zero_offset=1)
    return repacked, quantized.dequantized()


@pytest.mark.parametrize("group_size", [32, 64, 128])
@pytest.mark.parametrize(("method", "bits"), [("awq", 4), ("gptq", 4), ("gptq", 8)])
def test_repacked_int_weights_dequantize_exactly(method: str, bits: int,
                                                 group_size: int) -> None:
    repacked, expected = _int_layout(method, bits, group_size)
    assert repacked.qweight.shape == (NUM_IN * bits // 32, NUM_OUT)
    assert repacked.zeros is not None and repacked.zeros.dtype == torch.uint8
    got = dequantize_int(repacked.qweight, repacked.zeros, repacked.scales, bits, group_size)
    assert torch.equal(got, expected)


@pytest.mark.parametrize("symmetric", [False, True])
@pytest.mark.parametrize("v1", [True, False])
def test_gptq_zero_points_of_both_versions(v1: bool, symmetric: bool) -> None:
    """v1 stores zero - 1 modulo 16 (a zero point of 0 wraps to 15); v2 the zero itself."""
    weight = _weight(1)
    weight[:, :32] = weight[:, :32].abs()  # a group whose minimum is >= 0: zero point 0
    quantized = quantize_groups(weight, 4, 32, symmetric)
    assert symmetric or int(quantized.zeros.min()) == 0
    t = gptq_tensors(quantized, 4, v1)
    repacked = from_gptq("p", t["qweight"], t["qzeros"], t["scales"], t["g_idx"], NUM_IN,
                         NUM_OUT, 4, 32, zero_offset=1 if v1 else 0)
    assert repacked.zeros is not None
    assert torch.equal(repacked.zeros.long(), quantized.zeros)


@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_weights_keep_their_values(per_channel: bool) -> None:
    t = fp8_tensors(_weight(2), per_channel)
    repacked = from_fp8("p", t["weight"], t["weight_scale"], NUM_IN, NUM_OUT)
    assert repacked.scales.shape == (NUM_OUT,) and repacked.scales.dtype == torch.float32
    assert torch.equal(dequantize_fp8(repacked.qweight, repacked.scales), fp8_dequantized(t))


def test_act_order_and_wrong_shapes_are_refused() -> None:
    quantized = quantize_groups(_weight(3), 4, 32)
    t = gptq_tensors(quantized, 4)
    shuffled = t["g_idx"][torch.randperm(NUM_IN, generator=torch.Generator().manual_seed(0))]
    with pytest.raises(QuantizationConfigError, match="act-order"):
        from_gptq("p", t["qweight"], t["qzeros"], t["scales"], shuffled, NUM_IN, NUM_OUT, 4,
                  32, zero_offset=1)
    with pytest.raises(ModelConfigError, match=r"p\.qweight: checkpoint shape"):
        from_awq("p", t["qweight"], t["qzeros"], t["scales"], NUM_IN, NUM_OUT, 32)


def _rows(num_rows: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randn(num_rows, NUM_IN, generator=generator).to(DEVICE, dtype)


def _assert_close(got: torch.Tensor, x: torch.Tensor, weight: torch.Tensor,
                  bias: torch.Tensor | None) -> None:
    """Within 1e-5 (float32) or 1e-2 (half dtypes: the output's rounding, and the
    interpreter's bfloat16 truncation) of the largest output, against float32 x W^T + b."""
    expected = x.float() @ weight.to(x.device).t()
    if bias is not None:
        expected += bias.float()
    assert got.dtype == x.dtype and got.shape == expected.shape
    tolerance = 1e-5 if x.dtype == torch.float32 else 1e-2
    error = float((got.float() - expected).abs().max() / expected.abs().max())
    assert error < tolerance


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_rows", ROWS)
@pytest.mark.parametrize(("method", "bits", "group_size"),
                         [("awq", 4, 32), ("awq", 4, 128), ("gptq", 4, 64), ("gptq", 8, 128)])
def test_int_kernel_equals_the_reference(method: str, bits: int, group_size: int,
                                         num_rows: int, dtype: torch.dtype) -> None:
    repacked, weight = _int_layout(method, bits, group_size, seed=num_rows)
    assert repacked.zeros is not None
    bias = torch.randn(NUM_OUT).to(DEVICE, dtype) if num_rows != 3 else None
    x = _rows(num_rows, dtype, seed=bits)
    got = int_matmul(x, repacked.qweight.to(DEVICE), repacked.zeros.to(DEVICE),
                     repacked.scales.to(DEVICE), bias, bits, group_size)
    _assert_close(got, x, weight, bias)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_rows", ROWS)
@pytest.mark.parametrize("per_channel", [True, False])
def test_fp8_kernel_equals_the_reference(per_channel: bool, num_rows: int,
                                         dtype: torch.dtype) -> None:
    t = fp8_tensors(_weight(num_rows), per_channel)
    repacked = from_fp8("p", t["weight"], t["weight_scale"], NUM_IN, NUM_OUT)
    bias = torch.randn(NUM_OUT).to(DEVICE, dtype) if num_rows != 3 else None
    x = _rows(num_rows, dtype, seed=5)
    got = fp8_matmul(x, repacked.qweight.to(DEVICE), repacked.scales.to(DEVICE), bias)
    _assert_close(got, x, fp8_dequantized(t), bias)


@pytest.mark.parametrize("kind", [WeightKind.INT, WeightKind.FP8])
def test_module_takes_strided_rows_on_both_paths(kind: WeightKind) -> None:
    """The MLP hands down_proj a column slice of gate_up: rows with a stride; the module's
    kernel path and its torch path (the CPU forward) agree on it."""
    if kind is WeightKind.INT:
        repacked, weight = _int_layout("awq", 4, 64)
        weight_format = QuantizedFormat(kind, 4, 64, torch.float16, "awq-int4-g64")
    else:
        t = fp8_tensors(_weight(4), per_channel=True)
        repacked, weight = from_fp8("p", t["weight"], t["weight_scale"], NUM_IN, NUM_OUT), \
            fp8_dequantized(t)
        weight_format = QuantizedFormat(kind, 8, 0, torch.float32, "fp8-e4m3")
    module = QuantizedLinear(NUM_IN, NUM_OUT, weight_format, True, torch.float32, DEVICE)
    with torch.no_grad():
        module.qweight.copy_(repacked.qweight)
        module.scales.copy_(repacked.scales)
        if module.zeros is not None and repacked.zeros is not None:
            module.zeros.copy_(repacked.zeros)
        assert module.bias is not None
        module.bias.normal_()
    torch.testing.assert_close(module.dequantized(), weight.to(DEVICE))
    wide = _rows(5, torch.float32, seed=6).repeat(1, 2)
    x = wide[:, NUM_IN:]  # [5, K] with a row stride of 2K
    module.use_triton = True
    got = module(x)
    _assert_close(got, x, weight, module.bias)
    module.use_triton = False
    if DEVICE == "cpu":
        torch.testing.assert_close(module(x), got, rtol=1e-5, atol=1e-5)
