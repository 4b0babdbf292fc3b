"""TorchModelRunner: KV sizing, block copies, FLOP estimates, dtypes, random weights."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from transformers import AutoModelForCausalLM, PreTrainedModel

from engine import (
    CacheConfig,
    EngineConfig,
    LLMEngine,
    RunnerConfig,
    SamplingParams,
    SchedulerConfig,
)
from engine.models.config import ModelConfig, ModelConfigError
from engine.models.loader import random_hf_state_dict
from engine.scheduler_output import SchedulerOutput
from engine.worker.cuda_graphs import graph_batch_sizes
from engine.worker.flops import _visible_keys, forward_flops, linear_params_per_token
from engine.worker.model_runner import TorchModelRunner, kv_bytes_per_block
from tests.engine.models.helpers import (
    BLOCK_SIZE,
    PagedDriver,
    RecordingSampler,
    Sequence,
    hf_greedy,
    make_runner,
    random_prompts,
)

# The seed of this module's `llama` checkpoint (the fixture in tests/engine/conftest.py).
LLAMA_SEED = 11


def _config(max_model_len: int, **runner: object) -> EngineConfig:
    """The engine configuration of a runner test: BLOCK_SIZE blocks, runner's options."""
    return EngineConfig(SchedulerConfig(max_model_len=max_model_len),
                        CacheConfig(block_size=BLOCK_SIZE), runner=RunnerConfig(**runner))


def test_kv_blocks_from_memory_budget(llama: tuple[Path, PreTrainedModel]) -> None:
    path, _ = llama
    config = ModelConfig.from_file(path)
    per_block = kv_bytes_per_block(config, BLOCK_SIZE, torch.float32)
    assert per_block == 2 * 2 * BLOCK_SIZE * 2 * 16 * 4  # K+V, layers, tokens, Hkv*D, bytes
    runner = TorchModelRunner.from_model_dir(
        path, _config(256, kv_cache_bytes=10 * per_block + 5)
    )
    assert runner.num_kv_blocks == 10 and runner.block_size == BLOCK_SIZE
    assert runner.kv_caches[0][0].shape == (10, BLOCK_SIZE, 2, 16)
    with pytest.raises(ModelConfigError, match="no block"):
        TorchModelRunner.from_model_dir(path, _config(256, kv_cache_bytes=5))
    with pytest.raises(ModelConfigError, match="RoPE table"):
        runner.__class__(runner.model, _config(4096, num_kv_blocks=4))


def test_copy_on_write_fork_continues_identically(llama: tuple[Path, PreTrainedModel]) -> None:
    """A fork shares full blocks and gets a copy of the partial last block (blocks_to_copy)."""
    path, hf = llama
    [prompt] = random_prompts([37], seed=8)
    driver = PagedDriver(make_runner(path))
    parent = Sequence("parent", prompt, 1)
    driver.run([parent], keep_blocks=True)  # prefill: 37 tokens in 3 blocks, one token sampled
    copy = driver.free_blocks.pop()
    child = Sequence("child", prompt, 1, output=list(parent.output), num_computed=37,
                     block_table=[*parent.block_table[:2], copy])
    driver.step([], {}, blocks_to_copy=[(parent.block_table[2], copy)])  # a copy-only step
    parent.max_new_tokens = child.max_new_tokens = 15
    driver.run([parent, child])
    assert child.output == parent.output == hf_greedy(hf, prompt, 15)


def test_empty_step_and_non_sampling_chunk(llama: tuple[Path, PreTrainedModel]) -> None:
    path, _ = llama
    runner = make_runner(path)
    assert runner.execute(SchedulerOutput(0, [], 0)).result().sampled_token_ids == {}
    driver = PagedDriver(runner)
    seq = Sequence("x", random_prompts([30], seed=9)[0], 1)
    chunk = driver.chunk(seq, 16)  # first half of the prompt: nothing to sample
    assert not chunk.needs_sample
    driver.step([chunk], {"x": seq})  # asserts that nothing was sampled
    assert seq.output == [] and seq.num_computed == 16


def test_half_precision_runs_close_to_float32(llama: tuple[Path, PreTrainedModel]) -> None:
    path, _ = llama
    prompts = random_prompts([25, 40], seed=10)
    logits = {}
    for dtype in (torch.float32, torch.bfloat16):
        sampler = RecordingSampler(256)
        runner = TorchModelRunner.from_model_dir(path, _config(256, num_kv_blocks=32),
                                                 dtype=dtype, sampler=sampler)
        assert runner.kv_caches[0][0].dtype == dtype
        PagedDriver(runner).run([Sequence(f"h{i}", p, 1) for i, p in enumerate(prompts)])
        logits[dtype] = torch.stack([sampler.logits[f"h{i}"][0] for i in range(2)])
        assert logits[dtype].dtype == torch.float32
    torch.testing.assert_close(logits[torch.bfloat16], logits[torch.float32], rtol=0.05,
                               atol=0.05)


def test_random_weights_match_hf_on_the_same_weights(llama: tuple[Path, PreTrainedModel]) -> None:
    path, _ = llama
    config = ModelConfig.from_file(path)
    hf = AutoModelForCausalLM.from_pretrained(path).eval()
    hf.load_state_dict(random_hf_state_dict(config, seed=3))
    runner = TorchModelRunner.from_random(config, 3, _config(256, num_kv_blocks=32))
    [prompt] = random_prompts([19], seed=12)
    seq = Sequence("r", prompt, 10)
    PagedDriver(runner).run([seq])
    assert seq.output == hf_greedy(hf, prompt, 10)


def test_flops_formula(llama: tuple[Path, PreTrainedModel]) -> None:
    path, _ = llama
    config = ModelConfig.from_file(path)
    e, i, q, kv = 64, 128, 64, 32
    assert linear_params_per_token(config) == 2 * (e * (q + 2 * kv) + q * e + 3 * e * i)
    runner = make_runner(path)
    # A decode at context 10: linear + lm_head + attention over 10 keys in 2 layers.
    expected = 2 * linear_params_per_token(config) + 2 * e * 256 + 2 * 4 * 16 * 4 * 10
    assert forward_flops(config, 1, 10, 1) == expected
    assert runner.estimate_flops(np.array([1]), np.array([10]), np.array([1])).tolist() == [
        expected]
    # Prefill of 4 tokens on a 6-token prefix: contexts 7, 8, 9, 10.
    attention = 2 * 4 * 16 * 4 * (7 + 8 + 9 + 10)
    assert forward_flops(config, 4, 10, 0) == 4 * 2 * linear_params_per_token(config) + attention
    assert forward_flops(config, 0, 10, 0) == 0.0


@pytest.mark.parametrize("window", [None, 1, 3, 8, 12, 40])
def test_visible_keys_with_windows(window: int | None) -> None:
    for num_new, ctx in [(1, 1), (1, 10), (5, 10), (10, 10), (4, 30)]:
        brute = sum(min(c, window or c) for c in range(ctx - num_new + 1, ctx + 1))
        assert _visible_keys(np.array([num_new]), np.array([ctx]), window).tolist() == [brute]


def test_cuda_graph_buckets() -> None:
    assert graph_batch_sizes(32) == [1, 2, 4, 8, 16, 24, 32]
    assert graph_batch_sizes(3) == [1, 2, 3]
    assert graph_batch_sizes(1) == [1]


def test_engine_with_preemption_and_parallel_samples_matches_hf(
    llama: tuple[Path, PreTrainedModel],
) -> None:
    """LLMEngine over the real runner: a KV cache too small for the batch forces preemption
    (recompute), and n=2 greedy samples share the prompt's blocks; every output equals HF's."""
    path, hf = llama
    config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=4, max_model_len=256),
        cache=CacheConfig(block_size=BLOCK_SIZE),
        runner=RunnerConfig(num_kv_blocks=12),
    )
    engine = LLMEngine(config, TorchModelRunner.from_model_dir(path, config))
    prompts = random_prompts([30, 45, 20, 37], seed=13)
    for i, prompt in enumerate(prompts):
        params = SamplingParams(temperature=0.0, max_tokens=20, n=2 if i == 1 else 1)
        engine.add_request(f"e{i}", prompt, params)
    outputs: dict[tuple[str, int], list[int]] = {}
    while engine.has_unfinished_requests():
        for out in engine.step():
            assert out.error is None
            outputs.setdefault((out.request_id, out.sample_index), []).extend(out.new_token_ids)
    assert engine.scheduler.num_preemptions_total > 0
    assert len(outputs) == 5
    for (request_id, _), tokens in outputs.items():
        assert tokens == hf_greedy(hf, prompts[int(request_id[1:])], 20), request_id
