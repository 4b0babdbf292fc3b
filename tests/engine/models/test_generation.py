"""Greedy generation over the paged KV cache is token-exact with HF transformers (float32, CPU),
each step taking the previous step's tokens on the host or, queued ahead of them (async
scheduling), from the runner."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from tests.engine.models.helpers import (
    PagedDriver,
    RecordingSampler,
    Sequence,
    hf_greedy,
    make_checkpoint,
    make_runner,
    random_prompts,
)


@pytest.fixture(params=[False, True], ids=["sync", "ahead"])
def ahead(request: pytest.FixtureRequest) -> bool:
    """Whether the driver queues each step before the previous step's tokens are back."""
    return bool(request.param)


def test_single_request_matches_hf(checkpoint: tuple[Path, PreTrainedModel],
                                   ahead: bool) -> None:
    path, hf = checkpoint
    [prompt] = random_prompts([37], seed=1)
    seq = Sequence("a", prompt, max_new_tokens=24)
    runner = make_runner(path)
    assert runner.model.fused_cpu_ops  # float32 on the CPU: the fused ops and kernels run
    assert runner.decode_forward is not None  # and decode steps run as one C++ call
    PagedDriver(runner, ahead=ahead).run([seq])
    assert seq.output == hf_greedy(hf, prompt, 24)


def test_mixed_batch_matches_hf(
    checkpoint: tuple[Path, PreTrainedModel], ahead: bool
) -> None:
    """Sequences of different lengths share every step (decodes batched with prefills)."""
    path, hf = checkpoint
    lengths, outputs = [5, 40, 17, 1, 33], [12, 6, 20, 9, 15]
    prompts = random_prompts(lengths, seed=2)
    seqs = [Sequence(f"r{i}", p, n) for i, (p, n) in enumerate(zip(prompts, outputs, strict=True))]
    PagedDriver(make_runner(path), ahead=ahead).run(seqs)
    for seq in seqs:
        assert seq.output == hf_greedy(hf, seq.prompt, seq.max_new_tokens), seq.request_id


def test_torch_path_matches_hf(
    checkpoint: tuple[Path, PreTrainedModel], ahead: bool
) -> None:
    """Without the fused CPU ops and the decode forward (the path CUDA and half precision
    take), still token-exact."""
    path, hf = checkpoint
    runner = make_runner(path, fuse_cpu_ops=False)
    assert not runner.model.fused_cpu_ops and runner.decode_forward is None
    prompts = random_prompts([5, 40, 17], seed=4)
    seqs = [Sequence(f"t{i}", p, 9) for i, p in enumerate(prompts)]
    PagedDriver(runner, ahead=ahead).run(seqs, token_budget=30)
    for seq in seqs:
        assert seq.output == hf_greedy(hf, seq.prompt, seq.max_new_tokens), seq.request_id


def test_chunked_prefill_matches_hf(
    checkpoint: tuple[Path, PreTrainedModel], ahead: bool
) -> None:
    """A small budget splits prompts into chunks over several steps, next to decodes."""
    path, hf = checkpoint
    prompts = random_prompts([70, 45, 23], seed=3)
    seqs = [Sequence(f"c{i}", p, 10) for i, p in enumerate(prompts)]
    PagedDriver(make_runner(path), ahead=ahead).run(seqs, token_budget=13)
    for seq in seqs:
        assert seq.output == hf_greedy(hf, seq.prompt, 10), seq.request_id


def test_prefix_from_cache_matches_hf(
    checkpoint: tuple[Path, PreTrainedModel], ahead: bool
) -> None:
    """A second request reuses the first one's full prompt blocks and computes only its tail."""
    path, hf = checkpoint
    [shared, tail_a, tail_b] = random_prompts([40, 9, 14], seed=4)
    driver = PagedDriver(make_runner(path), ahead=ahead)
    first = Sequence("first", shared + tail_a, 5)
    driver.run([first], keep_blocks=True)
    num_cached = 32  # two full blocks of the shared prefix
    second = Sequence("second", shared + tail_b, 12, num_computed=num_cached,
                      block_table=first.block_table[:2])
    driver.run([second])
    assert second.output == hf_greedy(hf, second.prompt, 12)


def test_logits_close_to_hf(
    checkpoint: tuple[Path, PreTrainedModel], ahead: bool
) -> None:
    path, hf = checkpoint
    prompts = random_prompts([29, 50], seed=5)
    sampler = RecordingSampler(hf.config.vocab_size)
    seqs = [Sequence(f"l{i}", p, 8) for i, p in enumerate(prompts)]
    PagedDriver(make_runner(path, sampler=sampler), ahead=ahead).run(seqs, token_budget=20)
    for seq in seqs:
        with torch.no_grad():
            full = torch.tensor([seq.prompt + seq.output[:-1]])
            expected = hf(full).logits[0, len(seq.prompt) - 1 :]  # [num_out, V]
        got = torch.stack(sampler.logits[seq.request_id])
        torch.testing.assert_close(got, expected, rtol=1e-4, atol=1e-4)


def test_sharded_checkpoint_loads(tmp_path: Path) -> None:
    hf = make_checkpoint(tmp_path, "llama", seed=7, max_shard_size="100KB")
    assert (tmp_path / "model.safetensors.index.json").exists()
    [prompt] = random_prompts([21], seed=6)
    seq = Sequence("s", prompt, 8)
    PagedDriver(make_runner(tmp_path)).run([seq])
    assert seq.output == hf_greedy(hf, prompt, 8)
