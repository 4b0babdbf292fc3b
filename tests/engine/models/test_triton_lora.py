"""The LoRA shrink/expand Triton kernels (engine.models.triton_lora) against the per-token torch
product, out[t] += x[t] @ a_t @ b_t of the token's slot, on adapters fused by LoraWeights.fuse
(under the Triton interpreter without CUDA: small shapes)."""

from __future__ import annotations

import os

import numpy as np
import torch

if not torch.cuda.is_available():
    # Must happen before triton decorates the kernels: @triton.jit reads it at import time.
    os.environ.setdefault("TRITON_INTERPRET", "1")

import pytest

from engine.models.config import ModelConfig, RopeConfig
from engine.models.lora import FUSED_TARGETS, LoraWeights, target_shapes
from engine.models.lora_tiles import plan_tokens
from engine.models.triton_lora import (
    TritonLoraStack,
    _shrink_kernel,
    lora_expand,
    lora_shrink,
)

if not torch.cuda.is_available() and type(_shrink_kernel).__name__ != "InterpretedFunction":
    raise RuntimeError(
        "no CUDA device and the Triton kernels were imported without TRITON_INTERPRET=1; "
        "run the tests with TRITON_INTERPRET=1 (make test sets it)"
    )

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
NUM_LAYERS = 2
MAX_RANK = 64
# Relative error (Frobenius norm of the difference over the norm of the expected output).
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 1e-2, torch.float16: 2e-3}
ALL_TARGETS = tuple(name for names in FUSED_TARGETS.values() for name in names)
# The four slots' adapters: (rank, targets, layers it adapts). Slot 1 lacks k_proj (a zero
# block of qkv's B^T), o_proj and gate_up's modules, and adapts layer 1 only.
ADAPTERS = (
    (8, ALL_TARGETS, (0, 1)),
    (16, ("q_proj", "v_proj", "down_proj"), (1,)),
    (64, ALL_TARGETS, (0, 1)),
    (16, ("k_proj", "o_proj", "up_proj"), (0, 1)),
)


def _config(hidden: int, intermediate: int, heads: int, kv_heads: int,
            head_dim: int) -> ModelConfig:
    return ModelConfig(
        architecture="LlamaForCausalLM", model_type="llama", vocab_size=32,
        hidden_size=hidden, intermediate_size=intermediate, num_layers=NUM_LAYERS,
        num_heads=heads, num_kv_heads=kv_heads, head_dim=head_dim, rms_norm_eps=1e-6,
        rope=RopeConfig(), max_position_embeddings=128, tie_word_embeddings=False,
        has_qkv_bias=False, has_o_bias=False, has_mlp_bias=False, has_qk_norm=False,
        sliding_windows=(None,) * NUM_LAYERS, dtype=torch.float32, bos_token_id=None,
        eos_token_ids=(),
    )


# (in, N) of (qkv, o, gate_up, down): (64, 96), (64, 64), (64, 96), (48, 64) and
# (96, 160), (96, 96), (96, 200), (100, 96).
CONFIGS = {
    "small": _config(hidden=64, intermediate=48, heads=4, kv_heads=1, head_dim=16),
    "odd": _config(hidden=96, intermediate=100, heads=3, kv_heads=1, head_dim=32),
}


def _adapter(config: ModelConfig, rank: int, targets: tuple[str, ...], layers: tuple[int, ...],
             seed: int, dtype: torch.dtype) -> LoraWeights:
    """Random A [r, in] and B [out, r] (scaled for unit-sized updates), fused as the runner
    fuses them (engine.worker.lora_cache)."""
    generator = torch.Generator().manual_seed(seed)
    shapes = target_shapes(config)
    modules: list[dict[str, tuple[torch.Tensor, torch.Tensor]]] = []
    for layer in range(config.num_layers):
        modules.append({
            name: (torch.randn(rank, shapes[name][0], generator=generator) / shapes[name][0] ** 0.5,
                   torch.randn(shapes[name][1], rank, generator=generator) / rank ** 0.5)
            for name in targets if layer in layers
        })
    out_features = {name: out for name, (_, out) in shapes.items()}
    return LoraWeights.fuse(modules, out_features, dtype, torch.device(DEVICE))


def _stack(config: ModelConfig, dtype: torch.dtype) -> tuple[TritonLoraStack, list[LoraWeights]]:
    stack = TritonLoraStack.for_model(config, len(ADAPTERS), MAX_RANK, dtype, DEVICE)
    adapters = [_adapter(config, rank, targets, layers, seed, dtype)
                for seed, (rank, targets, layers) in enumerate(ADAPTERS)]
    for slot, weights in enumerate(adapters):
        stack.set_slot(slot, weights)
    return stack, adapters


def _reference(adapters: list[LoraWeights | None], layer: int, product: str, x: torch.Tensor,
               out: torch.Tensor, token_slots: np.ndarray) -> torch.Tensor:
    """out + each token's update, token by token, in float64."""
    expected = out.double()
    for t, slot in enumerate(token_slots.tolist()):
        weights = adapters[slot] if slot >= 0 else None
        matrices = None if weights is None else weights.layers[layer].get(product)
        if matrices is not None:
            expected[t] += x[t].double() @ matrices.a_t.double() @ matrices.b_t.double()
    return expected


def _check(got: torch.Tensor, expected: torch.Tensor, out: torch.Tensor,
           token_slots: np.ndarray) -> None:
    assert got.dtype == out.dtype
    base = torch.from_numpy(token_slots < 0).to(got.device)
    assert torch.equal(got[base], out[base])  # base-model rows untouched
    error = (got.double() - expected).norm() / expected.norm()
    assert error < TOLERANCE[got.dtype], float(error)


def _slots(num_tokens: int, seed: int) -> np.ndarray:
    """A mix of the four slots and the base model (every one present from 7 tokens)."""
    if num_tokens == 1:
        return np.array([2], dtype=np.int64)
    slots = np.resize(np.arange(-1, len(ADAPTERS), dtype=np.int64), num_tokens)
    return np.random.default_rng(seed).permutation(slots)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("num_tokens", [1, 7, 33])
@pytest.mark.parametrize("config_name", sorted(CONFIGS))
def test_mixed_slots_match_the_torch_product(config_name: str, num_tokens: int,
                                             dtype: torch.dtype) -> None:
    config = CONFIGS[config_name]
    stack, adapters = _stack(config, dtype)
    token_slots = _slots(num_tokens, seed=num_tokens)
    plan = plan_tokens(token_slots, DEVICE)  # once per step, for every layer and product
    generator = torch.Generator().manual_seed(num_tokens)
    for layer in range(NUM_LAYERS):
        for product in FUSED_TARGETS:
            in_features, n_features = stack.a[product].shape[3], stack.b[product].shape[3]
            x = torch.randn(num_tokens, in_features, generator=generator).to(DEVICE, dtype)
            out = torch.randn(num_tokens, n_features, generator=generator).to(DEVICE, dtype)
            got = out.clone()
            stack.apply(layer, product, x, got, plan)
            expected = _reference(list(adapters), layer, product, x, out, token_slots)
            _check(got, expected, out, token_slots)


def test_shrink_writes_each_token_product_and_splits_add_up() -> None:
    """h.sum(0) holds x[t] @ A^T in each target's block, up to the slot's rank; the expand of
    a split reduction (one split empty) gives the unsplit result."""
    config = CONFIGS["odd"]
    stack, adapters = _stack(config, torch.float32)
    token_slots = _slots(33, seed=5)
    generator = torch.Generator().manual_seed(5)
    x = torch.randn(33, config.hidden_size, generator=generator).to(DEVICE)
    out = torch.randn(33, config.q_size + 2 * config.kv_size, generator=generator).to(DEVICE)
    ranks = stack.ranks["qkv"][1]
    results = []
    for split_k in (1, 3):
        h = lora_shrink(x, stack.a["qkv"][1], token_slots, ranks, split_k=split_k)
        assert h.shape == (split_k, 33, 3 * stack.rank_cap) and h.dtype == torch.float32
        product = h.sum(0)
        for t, slot in enumerate(token_slots.tolist()):
            if slot < 0:
                continue
            matrices = adapters[slot].layers[1]["qkv"]
            row = 0
            for target, rank in enumerate(matrices.ranks):
                block = target * stack.rank_cap
                torch.testing.assert_close(product[t, block : block + rank],
                                           x[t] @ matrices.a_t[:, row : row + rank])
                row += rank
        got = out.clone()
        lora_expand(h, stack.b["qkv"][1], token_slots, ranks, got, stack.bounds["qkv"])
        results.append(got)
    _check(results[0], _reference(list(adapters), 1, "qkv", x, out, token_slots), out,
           token_slots)
    torch.testing.assert_close(results[1], results[0], rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_all_tokens_on_one_slot(dtype: torch.dtype) -> None:
    config = CONFIGS["odd"]
    stack, adapters = _stack(config, dtype)
    token_slots = np.full(33, 2, dtype=np.int64)  # rank 64, one tile of 64 tokens
    generator = torch.Generator().manual_seed(7)
    for product in ("qkv", "gate_up"):
        in_features, n_features = stack.a[product].shape[3], stack.b[product].shape[3]
        x = torch.randn(33, in_features, generator=generator).to(DEVICE, dtype)
        out = torch.randn(33, n_features, generator=generator).to(DEVICE, dtype)
        got = out.clone()
        # The slots as a device tensor: apply plans the tokens itself.
        stack.apply(0, product, x, got, torch.from_numpy(token_slots).to(DEVICE))
        _check(got, _reference(list(adapters), 0, product, x, out, token_slots), out,
               token_slots)


def test_no_token_on_a_slot_leaves_out_unchanged() -> None:
    config = CONFIGS["small"]
    stack, _ = _stack(config, torch.float32)
    token_slots = np.full(7, -1, dtype=np.int64)
    plan = plan_tokens(token_slots, DEVICE)
    assert plan.num_tiles == 0 and plan.num_tokens == 7
    x = torch.randn(7, config.hidden_size, device=DEVICE)
    out = torch.randn(7, config.q_size + 2 * config.kv_size, device=DEVICE)
    got = out.clone()
    stack.apply(1, "qkv", x, got, plan)
    assert torch.equal(got, out)


def test_set_slot_replaces_and_empties_an_adapter() -> None:
    """A rank-8 adapter over the rank-64 one of slot 2 leaves none of the old rows behind;
    an emptied slot adds nothing."""
    config = CONFIGS["small"]
    stack, adapters = _stack(config, torch.float32)
    adapters[2] = _adapter(config, 8, ("q_proj", "gate_proj"), (0, 1), seed=11,
                           dtype=torch.float32)
    stack.set_slot(2, adapters[2])
    token_slots = _slots(33, seed=2)
    generator = torch.Generator().manual_seed(3)
    x = torch.randn(33, config.hidden_size, generator=generator).to(DEVICE)
    for product, n_features in (("qkv", config.q_size + 2 * config.kv_size),
                                ("gate_up", 2 * config.intermediate_size)):
        out = torch.randn(33, n_features, generator=generator).to(DEVICE)
        got = out.clone()
        stack.apply(1, product, x, got, token_slots)
        _check(got, _reference(list(adapters), 1, product, x, out, token_slots), out,
               token_slots)
    stack.set_slot(2, None)
    assert not bool(stack.ranks["qkv"][:, 2].any()) and not bool(stack.a["qkv"][:, 2].any())
    out = torch.randn(33, config.hidden_size, generator=generator).to(DEVICE)
    got = out.clone()
    stack.apply(1, "o", x, got, token_slots)
    emptied: list[LoraWeights | None] = [*adapters[:2], None, adapters[3]]
    _check(got, _reference(emptied, 1, "o", x, out, token_slots), out, token_slots)
    assert torch.equal(got[torch.from_numpy(token_slots == 2).to(DEVICE)],
                       out[torch.from_numpy(token_slots == 2).to(DEVICE)])


def test_plan_groups_tokens_by_slot_in_tiles() -> None:
    token_slots = np.array([1, -1, 0, 1, 1, -1, 0] + [3] * 40, dtype=np.int64)
    plan = plan_tokens(token_slots, "cpu")
    assert plan.num_tokens == 47 and plan.block_m == 64  # 40 tokens on slot 3
    assert plan.order.tolist() == [2, 6, 0, 3, 4, *range(7, 47)]
    assert plan.tile_slot.tolist() == [0, 1, 3]
    assert plan.tile_start.tolist() == [0, 2, 5]
    assert plan.tile_len.tolist() == [2, 3, 40]
    plan = plan_tokens(token_slots, "cpu", block_m=16)
    assert plan.tile_slot.tolist() == [0, 1, 3, 3, 3]
    assert plan.tile_start.tolist() == [0, 2, 5, 21, 37]
    assert plan.tile_len.tolist() == [2, 3, 16, 16, 8]
    assert plan_tokens(np.array([0] * 17), "cpu").block_m == 32
    assert plan_tokens(np.array([0] * 16), "cpu").block_m == 16
