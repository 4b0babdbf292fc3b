"""The fused residual add + RMSNorm Triton kernel against the torch ops it replaces, and a whole
model run with it against HF transformers (under the Triton interpreter without CUDA)."""

from __future__ import annotations

import os
from pathlib import Path

import torch

if not torch.cuda.is_available():
    # Must happen before triton decorates the kernel: @triton.jit reads it at import time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest
from transformers import PreTrainedModel

from engine.models.decoder import RMSNorm
from engine.models.triton_add_norm import add_rms_norm
from tests.engine.models.helpers import (
    PagedDriver,
    Sequence,
    hf_greedy,
    make_checkpoint,
    make_runner,
    random_prompts,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape", [(1, 48), (7, 64), (3, 200)])
def test_add_and_norm_equal_the_torch_ops(dtype: torch.dtype, shape: tuple[int, int]) -> None:
    generator = torch.Generator().manual_seed(shape[0] * 1000 + shape[1])
    x = torch.randn(shape, generator=generator).to(DEVICE, dtype)
    residual = torch.randn(shape, generator=generator).to(DEVICE, dtype)
    norm = RMSNorm(shape[1], 1e-6).to(DEVICE, dtype)
    with torch.no_grad():
        norm.weight.copy_(torch.rand(shape[1], generator=generator) + 0.5)
        expected, expected_sum = norm.add_and_norm(x, residual.clone())
        in_place = residual.clone()
        got = add_rms_norm(x, in_place, norm.weight, norm.eps)
    if DEVICE == "cpu" and dtype == torch.bfloat16:
        # The interpreter rounds float32 to bfloat16 toward zero (a GPU rounds to nearest
        # even, as torch does): the sum it writes is the truncated exact sum.
        exact = (x.float() + residual.float()).view(torch.int32)
        expected_sum = (exact & ~0xFFFF).view(torch.float32).to(dtype)
    assert torch.equal(in_place, expected_sum)  # the sum, rounded alike, written in place
    assert got.dtype == dtype
    # The same formula; the reduction order, rsqrt and (interpreted) the two bfloat16
    # roundings may each move a value by one unit in the last place of the dtype.
    tolerance = {torch.float32: 1e-5, torch.bfloat16: 2e-2, torch.float16: 2e-3}[dtype]
    torch.testing.assert_close(got, expected, rtol=tolerance, atol=tolerance)


@pytest.mark.skipif(DEVICE == "cuda", reason="on CUDA every runner uses the kernel: "
                    "test_engine_devices.py runs whole models with it against HF")
def test_a_model_with_the_kernel_decodes_like_hf(tmp_path: Path) -> None:
    """A CPU runner switched to the kernel, under the Triton interpreter."""
    hf: PreTrainedModel = make_checkpoint(tmp_path, "llama", seed=21)
    runner = make_runner(tmp_path, fuse_cpu_ops=False)
    runner.model.use_fused_cuda_ops()
    [prompt] = random_prompts([19], seed=22)
    seq = Sequence("k", prompt, 6)
    PagedDriver(runner).run([seq])
    assert seq.output == hf_greedy(hf, prompt, 6)
