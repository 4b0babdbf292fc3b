"""The fused CPU ops against the torch forms they replace."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from engine.attention.torch_paged import write_kv
from engine.models import cpu_ops
from engine.models.config import RopeConfig
from engine.models.rope import RotaryTable, apply_rope

GEN = torch.Generator().manual_seed(0)


@pytest.mark.parametrize("num_rows", [1, 5, 300])  # 300 rows: the multi-threaded branch
def test_rms_norm(num_rows: int) -> None:
    x, weight = torch.randn(num_rows, 512, generator=GEN), torch.randn(512, generator=GEN)
    expected = F.rms_norm(x, (512,), weight, 1e-6)
    torch.testing.assert_close(cpu_ops.rms_norm(x, weight, 1e-6), expected)


def test_rms_norm_adds_the_residual_in_place() -> None:
    x, residual = torch.randn(7, 64, generator=GEN), torch.randn(7, 64, generator=GEN)
    weight = torch.randn(64, generator=GEN)
    total = x + residual
    out = cpu_ops.rms_norm(x, weight, 1e-5, residual)
    torch.testing.assert_close(residual, total, rtol=0, atol=0)
    torch.testing.assert_close(out, F.rms_norm(total, (64,), weight, 1e-5))


@pytest.mark.parametrize("num_rows", [1, 3, 200])
def test_silu_and_mul(num_rows: int) -> None:
    gate_up = 4 * torch.randn(num_rows, 2 * 1408, generator=GEN)
    gate_up[0, :4] = torch.tensor([-200.0, -90.0, 90.0, 200.0])  # the clamped exp's ends
    expected = F.silu(gate_up[:, :1408]) * gate_up[:, 1408:]
    torch.testing.assert_close(cpu_ops.silu_and_mul(gate_up), expected)


@pytest.mark.parametrize("num_tokens", [2, 100])
def test_rope_write_kv(num_tokens: int) -> None:
    """q and k rotated in place as apply_rope does; k and v land in their slots, -1 skips."""
    num_heads, num_kv_heads, head_dim, block_size = 8, 2, 32, 16
    table = RotaryTable(RopeConfig(theta=10000.0), head_dim, 512, 512, torch.float32,
                        torch.device("cpu"))
    qkv = torch.randn(num_tokens, (num_heads + 2 * num_kv_heads) * head_dim, generator=GEN)
    positions = torch.randint(0, 512, (num_tokens,), generator=GEN)
    slots = torch.randperm(16 * block_size, generator=GEN)[:num_tokens]
    slots[1] = -1
    heads = qkv.view(num_tokens, -1, head_dim)
    cos, sin = table.lookup(positions)
    rotated = apply_rope(heads[:, : num_heads + num_kv_heads], cos, sin)
    shape = (16, block_size, num_kv_heads, head_dim)
    expected_k, expected_v = torch.zeros(shape), torch.zeros(shape)
    write_kv(rotated[:, num_heads:], heads[:, num_heads + num_kv_heads :], expected_k,
             expected_v, slots)
    k_cache, v_cache = torch.zeros(shape), torch.zeros(shape)
    values = heads[:, num_heads + num_kv_heads :].clone()
    cpu_ops.rope_write_kv(qkv, num_heads, num_kv_heads, positions, table.cos, table.sin, slots,
                          k_cache, v_cache)
    torch.testing.assert_close(heads[:, : num_heads + num_kv_heads], rotated)
    torch.testing.assert_close(heads[:, num_heads + num_kv_heads :], values, rtol=0, atol=0)
    torch.testing.assert_close(k_cache, expected_k)
    torch.testing.assert_close(v_cache, expected_v, rtol=0, atol=0)
