"""The one-call decode forward (engine.models.cpu_decode) against the layer-by-layer path."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import PreTrainedModel

from engine.checkpoints.lora_adapter import TARGET_MODULES
from engine.models import cpu_decode
from engine.models.batch import ForwardBatch
from engine.models.config import ModelConfig
from engine.models.cpu_decode_lora import CpuLoraKernels
from engine.models.lora import LoraSlots, LoraWeights, target_shapes
from engine.models.quantized.panels import float_panels
from engine.worker.model_runner import TorchModelRunner
from tests.engine.models.helpers import (
    VOCAB,
    PagedDriver,
    RecordingSampler,
    Sequence,
    make_runner,
    random_prompts,
)

Checkpoint = tuple[Path, PreTrainedModel]  # the conftest fixture: directory, HF model


def _run(path: Path, cpu_decode_rows: int) -> tuple[list[Sequence], RecordingSampler, int]:
    """19 sequences of different lengths: decode steps shrink from 19 rows (blocks of 8, 8 and
    3 rows in the kernel's products) to 1 as they end. Returns them, what the sampler saw, and
    how many steps the decode forward ran."""
    sampler = RecordingSampler(256)
    runner = make_runner(path, sampler=sampler, cpu_decode_rows=cpu_decode_rows)
    calls = [0]
    if runner.decode_forward is not None:
        runner.decode_forward = _Counted(runner.decode_forward, calls)  # type: ignore[assignment]
    prompts = random_prompts([3, 70, 17, 1, 33, 48, 9, 26, 55] * 2 + [12], seed=7)
    seqs = [Sequence(f"s{i}", p, 4 + 2 * i) for i, p in enumerate(prompts)]
    PagedDriver(runner).run(seqs, token_budget=128)
    return seqs, sampler, calls[0]


class _Counted:
    """A decode forward that counts its calls."""

    def __init__(self, inner: cpu_decode.CpuDecodeForward, calls: list[int]) -> None:
        self.inner, self.calls = inner, calls

    def can_run(self, batch: ForwardBatch, lora: LoraSlots | None = None) -> bool:
        return self.inner.can_run(batch, lora)

    def __call__(self, batch: ForwardBatch, lora: LoraSlots | None = None) -> torch.Tensor:
        self.calls[0] += 1
        return self.inner(batch, lora)


def test_matches_the_layer_path(checkpoint: Checkpoint) -> None:
    """Same tokens, logits within rounding, for every row count from 19 down to 1."""
    layered, layered_logits, no_calls = _run(checkpoint[0], cpu_decode_rows=0)
    fused, fused_logits, calls = _run(checkpoint[0], cpu_decode_rows=cpu_decode.MAX_ROWS)
    assert no_calls == 0 and calls > 0
    for a, b in zip(layered, fused, strict=True):
        assert a.output == b.output, a.request_id
        torch.testing.assert_close(torch.stack(fused_logits.logits[b.request_id]),
                                   torch.stack(layered_logits.logits[a.request_id]),
                                   rtol=1e-4, atol=1e-4)


def test_rows_beyond_the_limit_take_the_layer_path(checkpoint: Checkpoint) -> None:
    """With a limit of 2 rows, wider decode steps go through the layers, and the tokens agree."""
    layered, _, _ = _run(checkpoint[0], cpu_decode_rows=0)
    limited, _, calls = _run(checkpoint[0], cpu_decode_rows=2)
    assert calls > 0
    assert [s.output for s in limited] == [s.output for s in layered]


def test_out_of_range_steps_are_refused(checkpoint: Checkpoint) -> None:
    runner = make_runner(checkpoint[0])
    forward = runner.decode_forward
    assert forward is not None
    num_slots = runner.num_kv_blocks * runner.block_size
    k_before = runner.kv_caches[0][0].clone()

    def batch(token: int, slot: int, block: int, position: int = 4) -> ForwardBatch:
        return ForwardBatch(
            input_ids=torch.tensor([token]), positions=torch.tensor([position]),
            slot_mapping=torch.tensor([slot]),
            block_tables=torch.tensor([[block]], dtype=torch.int32),
            query_start_loc=torch.tensor([0, 1], dtype=torch.int32),
            context_lens=torch.tensor([5], dtype=torch.int32),
            logits_indices=torch.tensor([0]),
        )

    assert forward.can_run(batch(1, 4, 0))
    max_positions = runner.model.rotary.cos.shape[0]  # type: ignore[union-attr]
    for bad in (batch(256, 4, 0), batch(1, num_slots, 0), batch(1, 4, runner.num_kv_blocks),
                batch(1, 4, 0, position=max_positions)):
        with pytest.raises(ValueError, match="out of range"):
            forward(bad)
    assert torch.equal(runner.kv_caches[0][0], k_before)  # nothing written


def test_can_run_only_decodes_within_the_limit(checkpoint: Checkpoint) -> None:
    forward = make_runner(checkpoint[0], cpu_decode_rows=3).decode_forward
    assert forward is not None

    def batch(num_seqs: int, rows_per_seq: int) -> ForwardBatch:
        num_tokens = num_seqs * rows_per_seq
        return ForwardBatch(
            input_ids=torch.zeros(num_tokens, dtype=torch.int64),
            positions=torch.zeros(num_tokens, dtype=torch.int64),
            slot_mapping=torch.zeros(num_tokens, dtype=torch.int64),
            block_tables=torch.zeros(num_seqs, 1, dtype=torch.int32),
            query_start_loc=torch.arange(0, num_tokens + 1, rows_per_seq, dtype=torch.int32),
            context_lens=torch.full((num_seqs,), rows_per_seq, dtype=torch.int32),
            logits_indices=torch.arange(rows_per_seq - 1, num_tokens, rows_per_seq),
        )

    assert forward.can_run(batch(3, 1))
    assert not forward.can_run(batch(4, 1))  # above the limit
    assert not forward.can_run(batch(1, 2))  # a prefill chunk


def test_panels_layout() -> None:
    weight = torch.arange(32 * 5, dtype=torch.float32).reshape(32, 5)
    packed = float_panels(weight).data
    assert packed.shape == (2, 5, 16)
    for n in range(32):
        for k in range(5):
            assert packed[n // 16, k, n % 16] == weight[n, k]
    gate_up = torch.cat([weight, -weight])  # gate rows, then up rows
    pairs = cpu_decode.interleaved_panels(gate_up).data
    assert torch.equal(pairs[0], packed[0]) and torch.equal(pairs[1], -packed[0])
    assert torch.equal(pairs[2], packed[1]) and torch.equal(pairs[3], -packed[1])


def test_copies_cost_the_weights_once_more(checkpoint: Checkpoint) -> None:
    runner = make_runner(checkpoint[0])
    assert runner.decode_forward is not None
    model = runner.model
    config: ModelConfig = model.config
    per_layer = (config.q_size + 2 * config.kv_size) * config.hidden_size \
        + config.hidden_size * config.q_size + 3 * config.hidden_size * config.intermediate_size
    expected = 4 * (config.num_layers * per_layer + config.vocab_size * config.hidden_size)
    assert runner.decode_forward.nbytes == expected


def test_unsupported_models_are_declined(checkpoint: Checkpoint) -> None:
    config = make_runner(checkpoint[0]).model.config
    cpu = torch.device("cpu")
    assert cpu_decode.supports(config, cpu, torch.float32)
    assert not cpu_decode.supports(config, cpu, torch.bfloat16)
    # a vocabulary, or a layer width, not in whole panels of 16
    assert not cpu_decode.supports(replace(config, vocab_size=250), cpu, torch.float32)
    assert not cpu_decode.supports(replace(config, intermediate_size=136), cpu, torch.float32)


def test_the_load_time_check_catches_a_wrong_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """supports() runs the kernel once on a tiny random model against its layers; a kernel
    whose logits are off is declined."""
    check = cpu_decode._agrees_with_layers.__wrapped__
    assert check()
    call = cpu_decode.CpuDecodeForward.__call__

    def off(self: cpu_decode.CpuDecodeForward, batch: ForwardBatch,
            lora: LoraSlots | None = None) -> torch.Tensor:
        logits = call(self, batch, lora)
        logits[batch.num_tokens - 1] *= 1.01  # the last row: the kernel's second row block
        return logits

    monkeypatch.setattr(cpu_decode.CpuDecodeForward, "__call__", off)
    assert not check()


@pytest.mark.parametrize("num_rows", [1, 5, 8, 19, 70])  # 19, 70: blocks of 8 rows and a tail
def test_panel_lm_head_equals_linear(num_rows: int) -> None:
    generator = torch.Generator().manual_seed(num_rows)
    weight, x = torch.randn(96, 40, generator=generator), torch.randn(num_rows, 40,
                                                                        generator=generator)
    lm_head = cpu_decode.PanelLinear(float_panels(weight))
    torch.testing.assert_close(lm_head(x), x @ weight.T, rtol=1e-5, atol=1e-5)


def test_layer_path_shares_the_lm_head_panels(checkpoint: Checkpoint) -> None:
    """With the decode forward, the layers' lm_head reads its panels (one copy, not a packed
    one as well); without it, the lm_head is packed like the other layers."""
    runner = make_runner(checkpoint[0])
    assert runner.decode_forward is not None
    assert isinstance(runner.model.lm_head, cpu_decode.PanelLinear)
    assert runner.model.lm_head.panels is runner.decode_forward.lm_head_panels
    assert not isinstance(make_runner(checkpoint[0], cpu_decode_rows=0).model.lm_head,
                          cpu_decode.PanelLinear)


def _random_lora(config: ModelConfig, rank: int, targets: tuple[str, ...], seed: int,
                 ) -> LoraWeights:
    """An adapter of random A and B (std 0.1) of `rank` on `targets`, in every layer."""
    generator = torch.Generator().manual_seed(seed)
    shapes = target_shapes(config)
    layers = [{name: (0.1 * torch.randn(rank, shapes[name][0], generator=generator),
                      0.1 * torch.randn(shapes[name][1], rank, generator=generator))
               for name in targets} for _ in range(config.num_layers)]
    return LoraWeights.fuse(layers, {name: out for name, (_, out) in shapes.items()},
                            torch.float32, torch.device("cpu"))


def _decode_batch(runner: TorchModelRunner, num_rows: int, seed: int) -> ForwardBatch:
    """A decode step of num_rows sequences over random contexts of up to 40 tokens, in the
    runner's cache (filled with random K and V), block tables shuffled."""
    generator = torch.Generator().manual_seed(seed)
    for k_cache, v_cache in runner.kv_caches:
        k_cache.copy_(torch.randn(k_cache.shape, generator=generator))
        v_cache.copy_(torch.randn(v_cache.shape, generator=generator))
    blocks_per_seq = 3
    contexts = torch.randint(1, blocks_per_seq * runner.block_size + 1, (num_rows,),
                             generator=generator, dtype=torch.int32)
    tables = torch.randperm(runner.num_kv_blocks, generator=generator)[
        : num_rows * blocks_per_seq].to(torch.int32).view(num_rows, blocks_per_seq)
    positions = contexts.to(torch.int64) - 1
    blocks = tables.gather(1, (positions // runner.block_size).view(-1, 1)).view(-1)
    return ForwardBatch(
        input_ids=torch.randint(0, VOCAB, (num_rows,), generator=generator),
        positions=positions,
        slot_mapping=blocks.to(torch.int64) * runner.block_size + positions % runner.block_size,
        block_tables=tables,
        query_start_loc=torch.arange(num_rows + 1, dtype=torch.int32),
        context_lens=contexts,
        logits_indices=torch.arange(num_rows),
    )


def _layer_logits(runner: TorchModelRunner, batch: ForwardBatch,
                  torch_products: bool = True) -> torch.Tensor:
    """The layer path's logits of the step, on a copy of the caches; torch_products: adapters'
    updates as torch's grouped products (the reference), else the runner's LoRA kernels."""
    caches = [(k.clone(), v.clone()) for k, v in runner.kv_caches]
    runner.attention.prepare(batch.attention_metadata())
    slots = runner.lora.slots if runner.lora is not None else None
    kernels = slots.kernels if slots is not None else None
    if slots is not None and torch_products:
        slots.kernels = None
        slots.bind(slots.token_slots)  # the plan and groups made anew
    try:
        with torch.inference_mode():
            return runner.model(batch, caches, runner.attention)
    finally:
        if slots is not None:
            slots.kernels = kernels
            slots.bind(slots.token_slots)


def _relative_error(got: torch.Tensor, expected: torch.Tensor) -> float:
    return float((got - expected).norm() / expected.norm())


def _four_adapters(config: ModelConfig) -> list[LoraWeights]:
    """Ranks 8, 16, 64 on all seven projections, and one of rank 16 on q_proj and v_proj."""
    return [_random_lora(config, 8, TARGET_MODULES, seed=1),
            _random_lora(config, 16, TARGET_MODULES, seed=2),
            _random_lora(config, 64, TARGET_MODULES, seed=3),
            _random_lora(config, 16, ("q_proj", "v_proj"), seed=4)]


# Rows of a step on four adapters and the base model: blocks of 8, 8 and 3 rows.
_ROW_SLOTS = [0, -1, 1, 2, 3, 0, -1, 2, 1, 3, 3, -1, 0, 1, 2, -1, 2, 0, 1]


def test_adapters_match_the_layer_path(checkpoint: Checkpoint) -> None:
    """Rows on four adapters (ranks 8, 16, 64 on all seven projections, one of rank 16 on
    q_proj and v_proj only) and on the base model in one step: the C++ forward's logits are
    the layer path's (its torch LoRA products), for 19 rows and for 1."""
    runner = make_runner(checkpoint[0])
    forward, lora = runner.decode_forward, runner.lora
    assert forward is not None and lora is not None
    config = runner.model_config
    slots = lora.slots
    for slot, weights in enumerate(_four_adapters(config)):
        slots.set_slot(slot, weights)
    for row_slots in (_ROW_SLOTS, [2]):
        batch = _decode_batch(runner, len(row_slots), seed=len(row_slots))
        slots.bind(None)
        base = _layer_logits(runner, batch)
        slots.bind(np.array(row_slots, dtype=np.int64))
        expected = _layer_logits(runner, batch)
        assert forward.can_run(batch, slots)
        got = forward(batch, slots)
        assert _relative_error(got, expected) < 1e-4
        for row, slot in enumerate(row_slots):  # adapters change the logits, base rows not
            changed = _relative_error(expected[row], base[row]) > 1e-3
            assert changed == (slot >= 0), (row, slot)


def test_adapted_steps_reuse_the_panels_of_a_slot(checkpoint: Checkpoint) -> None:
    """A slot's adapter is packed once, when it enters the slot, and again only when another
    takes the slot; the repacked slot gives the new adapter's logits."""
    runner = make_runner(checkpoint[0])
    forward, lora = runner.decode_forward, runner.lora
    assert forward is not None and lora is not None
    config = runner.model_config
    slots = lora.slots
    kernels = slots.kernels
    assert isinstance(kernels, CpuLoraKernels)
    slots.set_slot(1, _random_lora(config, 16, TARGET_MODULES, seed=5))
    first = kernels.panels(1)
    assert first is not None and kernels.nbytes == first.nbytes
    batch = _decode_batch(runner, 3, seed=0)
    slots.bind(np.array([1, -1, 1], dtype=np.int64))
    forward(batch, slots)
    forward(batch, slots)
    assert kernels.panels(1) is first
    slots.set_slot(1, _random_lora(config, 8, ("o_proj", "down_proj"), seed=6))
    expected = _layer_logits(runner, batch)
    got = forward(batch, slots)
    assert kernels.panels(1) is not first
    assert _relative_error(got, expected) < 1e-4
    slots.set_slot(1, None)
    assert kernels.panels(1) is None and kernels.nbytes == 0


def test_rows_on_missing_adapters_are_refused(checkpoint: Checkpoint) -> None:
    """A row's adapter slot must be -1 or a slot that holds an adapter."""
    runner = make_runner(checkpoint[0])
    forward, lora = runner.decode_forward, runner.lora
    assert forward is not None and lora is not None
    lora.slots.set_slot(0, _random_lora(runner.model_config, 8, TARGET_MODULES, seed=7))
    batch = _decode_batch(runner, 2, seed=1)
    k_before = runner.kv_caches[0][0].clone()
    for bad in ([0, 1], [0, lora.slots.num_slots], [-2, 0]):  # empty, past the slots, below -1
        lora.slots.bind(np.array(bad, dtype=np.int64))
        with pytest.raises(ValueError, match="out of range"):
            forward(batch, lora.slots)
    assert torch.equal(runner.kv_caches[0][0], k_before)  # nothing written


def _prefill_batch(runner: TorchModelRunner, lengths: list[int]) -> ForwardBatch:
    """A step of fresh prompts of these lengths (each sequence's tokens in a row of the step,
    every token's logits), in blocks of the runner's cache taken in turn."""
    generator = torch.Generator().manual_seed(len(lengths))
    block_size = runner.block_size
    tables, positions, slots, blocks_used = [], [], [], 0
    width = max(-(-n // block_size) for n in lengths)
    for n in lengths:
        table = list(range(blocks_used, blocks_used + -(-n // block_size)))
        blocks_used += len(table)
        tables.append(table + [0] * (width - len(table)))
        positions += list(range(n))
        slots += [table[p // block_size] * block_size + p % block_size for p in range(n)]
    total = sum(lengths)
    return ForwardBatch(
        input_ids=torch.randint(0, VOCAB, (total,), generator=generator),
        positions=torch.tensor(positions, dtype=torch.int64),
        slot_mapping=torch.tensor(slots, dtype=torch.int64),
        block_tables=torch.tensor(tables, dtype=torch.int32),
        query_start_loc=torch.tensor([0, *np.cumsum(lengths)], dtype=torch.int32),
        context_lens=torch.tensor(lengths, dtype=torch.int32),
        logits_indices=torch.arange(total),
    )


def test_layer_path_updates_match_torch_products(checkpoint: Checkpoint) -> None:
    """A prefill step of 9 prompts (147 tokens: groups of four rows and the shorter tails of
    each prompt) on four adapters and the base model: the layer path with the C++ LoRA kernels
    gives the logits of the same path with torch's grouped products, and the adapters change
    them."""
    runner = make_runner(checkpoint[0])
    lora = runner.lora
    assert lora is not None and isinstance(lora.slots.kernels, CpuLoraKernels)
    for slot, weights in enumerate(_four_adapters(runner.model_config)):
        lora.slots.set_slot(slot, weights)
    lengths, prompt_slots = [30, 1, 17, 25, 9, 33, 2, 16, 14], [0, 2, -1, 1, 3, 2, 0, -1, 1]
    batch = _prefill_batch(runner, lengths)
    token_slots = np.repeat(np.array(prompt_slots, dtype=np.int64), lengths)
    lora.slots.bind(None)
    base = _layer_logits(runner, batch)
    lora.slots.bind(token_slots)
    expected = _layer_logits(runner, batch)
    got = _layer_logits(runner, batch, torch_products=False)
    assert _relative_error(got, expected) < 1e-4
    for token, slot in enumerate(token_slots):  # adapters change the logits, base tokens not
        changed = _relative_error(expected[token], base[token]) > 1e-3
        assert changed == (slot >= 0), (token, slot)
        torch.testing.assert_close(got[token], expected[token], rtol=1e-3, atol=1e-3)


def test_layer_path_updates_refuse_what_the_plan_does_not_hold(checkpoint: Checkpoint) -> None:
    """A row on an empty slot, or inputs of another step's size: a ValueError, out untouched."""
    runner = make_runner(checkpoint[0])
    lora = runner.lora
    assert lora is not None
    kernels = lora.slots.kernels
    assert isinstance(kernels, CpuLoraKernels)
    lora.slots.set_slot(0, _random_lora(runner.model_config, 8, TARGET_MODULES, seed=8))
    config = runner.model_config
    x = torch.randn(3, config.hidden_size)
    out = torch.zeros(3, config.q_size + 2 * config.kv_size)
    plan = kernels.plan(np.array([0, 1, -1], dtype=np.int64))  # slot 1 is empty
    with pytest.raises(ValueError, match="out of range"):
        kernels.apply(0, "qkv", x, out, plan)
    plan = kernels.plan(np.array([0, -1], dtype=np.int64))
    with pytest.raises(ValueError, match="do not match"):
        kernels.apply(0, "qkv", x, out, plan)
    with pytest.raises(ValueError, match="do not match"):
        kernels.apply(config.num_layers, "qkv", x[:2], out[:2], plan)
    assert not bool(out.any())
    kernels.apply(0, "qkv", x[:2], out[:2], plan)
    assert bool(out[0].any()) and not bool(out[1:].any())  # row 0's adapter, row 1 the base
