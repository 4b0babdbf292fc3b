"""LoRA adapters batched in one step are token-exact with HF transformers + PEFT (float32, CPU),
for every supported architecture: one adapter alone at ranks 8, 16 and 64 (rsLoRA too), four
adapters and the base model in one batch with chunked prefills, on the fused CPU path and the
torch path; the adapter merged into the weights gives the unmerged path's tokens; and through
the engine: preemption with resumption, n > 1, more adapters than slots."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from engine import LLMEngine, LoraConfig, LoraRequest, SamplingParams
from engine.config import CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig
from engine.models.batch import ForwardBatch
from engine.models.lora import LoraSlots
from engine.worker.cuda_graphs import DecodeCudaGraphs
from engine.worker.model_runner import TorchModelRunner
from tests.engine.models.helpers import (
    PagedDriver,
    Sequence,
    hf_greedy,
    make_runner,
    random_prompts,
)
from tests.engine.models.lora_adapters import Adapter, make_adapter

RANKS = (8, 16, 64)


@pytest.fixture(scope="module")
def adapters(checkpoint: tuple[Path, PreTrainedModel],
             tmp_path_factory: pytest.TempPathFactory) -> list[Adapter]:
    """Four adapters of the module's checkpoint on all seven projections: ranks 8, 16, 64,
    and 16 with rsLoRA."""
    path, _ = checkpoint
    root = tmp_path_factory.mktemp(f"adapters-{path.name}")
    made = [make_adapter(path, root / f"r{rank}", rank, seed=rank) for rank in RANKS]
    made.append(make_adapter(path, root / "rs16", 16, seed=99, use_rslora=True, alpha=8))
    return made


@pytest.mark.parametrize("index", range(len(RANKS) + 1), ids=["r8", "r16", "r64", "rslora16"])
def test_one_adapter_matches_peft(checkpoint: tuple[Path, PreTrainedModel],
                                  adapters: list[Adapter], index: int) -> None:
    path, hf = checkpoint
    adapter = adapters[index]
    [prompt] = random_prompts([29], seed=index)
    seq = Sequence("a", prompt, max_new_tokens=12, lora=adapter.lora)
    runner = make_runner(path)
    PagedDriver(runner).run([seq])
    expected = hf_greedy(adapter.reference, prompt, 12)
    assert seq.output == expected
    assert expected != hf_greedy(hf, prompt, 12)  # the adapter changes the tokens


@pytest.mark.parametrize("fuse_cpu_ops", [True, False], ids=["fused", "torch"])
def test_four_adapters_and_base_in_one_batch_match_peft(
    checkpoint: tuple[Path, PreTrainedModel], adapters: list[Adapter], fuse_cpu_ops: bool
) -> None:
    """Each adapter twice and the base model twice, prompts chunked under a 13-token budget
    next to decodes: every step mixes adapters, the base model, prefills and decodes."""
    path, hf = checkpoint
    runner = make_runner(path, fuse_cpu_ops=fuse_cpu_ops)
    choices: list[Adapter | None] = [*adapters, None, *adapters, None]
    prompts = random_prompts([5 + 7 * i for i in range(len(choices))], seed=3)
    seqs = [Sequence(f"s{i}", prompt, 6 + i % 4, lora=None if a is None else a.lora)
            for i, (prompt, a) in enumerate(zip(prompts, choices, strict=True))]
    PagedDriver(runner).run(seqs, token_budget=13)
    for seq, adapter in zip(seqs, choices, strict=True):
        reference = hf if adapter is None else adapter.reference
        assert seq.output == hf_greedy(reference, seq.prompt, seq.max_new_tokens), seq.request_id


def test_the_triton_kernels_give_peft_tokens(
    checkpoint: tuple[Path, PreTrainedModel], adapters: list[Adapter]
) -> None:
    """The SGMV kernels CUDA uses (engine.models.triton_lora, here under the Triton
    interpreter) in place of the grouped products: four adapters and the base model in one
    batch, chunked prefills next to decodes, PEFT's tokens."""
    from engine.models.triton_lora import TritonLoraStack

    path, hf = checkpoint
    runner = make_runner(path, fuse_cpu_ops=False)
    assert runner.lora is not None and runner.decode_forward is None
    runner.lora.slots.kernels = TritonLoraStack.for_model(
        runner.model_config, runner.lora.slots.num_slots, 64, torch.float32,
        torch.device("cpu"))
    choices: list[Adapter | None] = [*adapters, None]
    prompts = random_prompts([6, 19, 11, 25, 8], seed=13)
    seqs = [Sequence(f"k{i}", prompt, 5, lora=None if a is None else a.lora)
            for i, (prompt, a) in enumerate(zip(prompts, choices, strict=True))]
    PagedDriver(runner).run(seqs, token_budget=24)
    for seq, adapter in zip(seqs, choices, strict=True):
        reference = hf if adapter is None else adapter.reference
        assert seq.output == hf_greedy(reference, seq.prompt, 5), seq.request_id


def test_adapted_decodes_through_the_graphs_static_buffers_give_peft_tokens(
    checkpoint: tuple[Path, PreTrainedModel], adapters: list[Adapter]
) -> None:
    """The adapted CUDA graphs' path (engine.worker.cuda_graphs with capture off, the SGMV
    kernels under the Triton interpreter): every decode step loads its tiles into the static
    buffers and the kernels run the graph's fixed grid, empty tiles included; four adapters,
    the base model twice, sequences ending at different steps (graph sizes 8, 4, 2, 1)."""
    from engine.models.triton_lora import TritonLoraStack

    path, hf = checkpoint
    runner = make_runner(path, fuse_cpu_ops=False)
    assert runner.lora is not None
    runner.lora.slots.kernels = TritonLoraStack.for_model(
        runner.model_config, runner.lora.slots.num_slots, 64, torch.float32,
        torch.device("cpu"))
    graphs = DecodeCudaGraphs(runner.model, runner.kv_caches, runner.attention,
                              max_num_seqs=8, max_blocks_per_seq=64, capture=False,
                              lora=runner.lora.slots)
    runner.graphs = graphs
    choices: list[Adapter | None] = [adapters[0], None, *adapters[1:], None]
    prompts = random_prompts([6, 19, 11, 25, 8, 14], seed=17)
    seqs = [Sequence(f"g{i}", prompt, 2 + 2 * i, lora=None if a is None else a.lora)
            for i, (prompt, a) in enumerate(zip(prompts, choices, strict=True))]
    PagedDriver(runner).run(seqs)
    for seq, adapter in zip(seqs, choices, strict=True):
        reference = hf if adapter is None else adapter.reference
        assert seq.output == hf_greedy(reference, seq.prompt, seq.max_new_tokens), seq.request_id
    # one prefill step, then every step decodes only, through the static buffers
    assert graphs.inputs.num_loads == max(s.max_new_tokens for s in seqs) - 1


def test_merged_adapter_gives_the_unmerged_tokens(
    checkpoint: tuple[Path, PreTrainedModel], adapters: list[Adapter], tmp_path: Path
) -> None:
    """PEFT merges the rank-16 adapter into a copy of the weights; tiergate serves that copy
    as a base model, and the same base with the adapter unmerged: the same tokens."""
    path, _ = checkpoint
    adapter = make_adapter(path, tmp_path / "to-merge", 16, seed=7)
    merged = adapter.peft_model.merge_and_unload()
    merged.save_pretrained(tmp_path / "merged")
    prompts = random_prompts([11, 30, 4], seed=5)
    unmerged = [Sequence(f"u{i}", p, 10, lora=adapter.lora) for i, p in enumerate(prompts)]
    PagedDriver(make_runner(path)).run(unmerged)
    merged_seqs = [Sequence(f"m{i}", p, 10) for i, p in enumerate(prompts)]
    PagedDriver(make_runner(tmp_path / "merged")).run(merged_seqs)
    assert [s.output for s in unmerged] == [s.output for s in merged_seqs]


def _engine(path: Path, num_kv_blocks: int, max_loras: int = 4) -> LLMEngine:
    config = EngineConfig(
        SchedulerConfig(max_num_batched_tokens=32, max_num_seqs=8, max_model_len=256),
        CacheConfig(block_size=16),
        runner=RunnerConfig(num_kv_blocks=num_kv_blocks, sampler_seed=0),
        lora=LoraConfig(max_loras=max_loras, max_cpu_loras=max(max_loras, 2)),
    )
    return LLMEngine(config, TorchModelRunner.from_model_dir(path, config))


def _run(engine: LLMEngine) -> dict[tuple[str, int], list[int]]:
    tokens: dict[tuple[str, int], list[int]] = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens.setdefault((output.request_id, output.sample_index), []).extend(
                output.new_token_ids)
    return tokens


def test_engine_preemption_n_and_slots_match_peft(
    checkpoint: tuple[Path, PreTrainedModel], adapters: list[Adapter]
) -> None:
    """Eight requests on four adapters and the base model, two of them n = 2, through an
    engine with two adapter slots and a KV pool too small for all: requests are preempted and
    resumed (recomputed on their adapter), adapters wait for slots, every token is PEFT's."""
    path, hf = checkpoint
    engine = _engine(path, num_kv_blocks=8, max_loras=2)
    choices: list[Adapter | None] = [*adapters, None, adapters[0], adapters[2], None]
    prompts = random_prompts([40, 21, 33, 9, 27, 45, 18, 36], seed=6)
    for i, (prompt, adapter) in enumerate(zip(prompts, choices, strict=True)):
        params = SamplingParams(temperature=0.0, max_tokens=20, ignore_eos=True,
                                n=2 if i in (1, 4) else 1)
        engine.add_request(f"q{i}", prompt, params,
                           lora=None if adapter is None else adapter.lora)
    tokens = _run(engine)
    assert engine.scheduler.num_preemptions_total > 0
    for i, (prompt, adapter) in enumerate(zip(prompts, choices, strict=True)):
        expected = hf_greedy(hf if adapter is None else adapter.reference, prompt, 20)
        samples = [tokens[(f"q{i}", index)] for index in range(2 if i in (1, 4) else 1)]
        assert all(sample == expected for sample in samples), f"q{i}"


def test_an_adapter_the_engine_cannot_load_ends_its_request(
    checkpoint: tuple[Path, PreTrainedModel], adapters: list[Adapter], tmp_path: Path
) -> None:
    """Read on the loader thread: the request ends with an error output naming the problem,
    the others run, and the hold on the adapter is released."""
    from engine import InvalidRequestError, LoraRequest

    path, _ = checkpoint
    engine = _engine(path, num_kv_blocks=16)
    engine.add_request("x", [5, 6, 7], SamplingParams(max_tokens=2),
                       lora=LoraRequest("gone", str(tmp_path)))
    engine.add_request("ok", [5, 6, 7], SamplingParams(max_tokens=2, ignore_eos=True))
    ends = {}
    while engine.has_unfinished_requests():
        for output in engine.step():
            if output.finished:
                ends[output.request_id] = output
    assert ends["x"].finish_reason == "error" and ends["x"].error_code == "adapter_invalid"
    assert ends["x"].error is not None and "adapter_model.safetensors is missing" in (
        ends["x"].error)
    assert ends["ok"].finish_reason == "length"
    runner = engine.runner
    assert isinstance(runner, TorchModelRunner) and runner.lora is not None
    assert not runner.lora._holds
    no_slots = _engine(path, num_kv_blocks=16, max_loras=0)
    with pytest.raises(InvalidRequestError, match="serves no LoRA adapters"):
        no_slots.add_request("y", [5, 6, 7], SamplingParams(max_tokens=2),
                             lora=adapters[0].lora)


def test_a_cold_adapter_never_stalls_the_steps(
    checkpoint: tuple[Path, PreTrainedModel], adapters: list[Adapter],
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """The adapter's read is held up until a base-model request has run to its end: the
    steps went on without it; then the adapter's request runs, PEFT's tokens."""
    import threading

    from engine.worker.lora_cache import LoraCache

    path, hf = checkpoint
    release = threading.Event()
    read = LoraCache._read

    def slow_read(self: LoraCache, lora: LoraRequest) -> object:
        assert release.wait(60)
        return read(self, lora)

    monkeypatch.setattr(LoraCache, "_read", slow_read)
    engine = _engine(path, num_kv_blocks=16)
    [prompt] = random_prompts([9], seed=11)
    params = SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True)
    engine.add_request("cold", prompt, params, lora=adapters[2].lora)
    engine.add_request("base", prompt, params)
    tokens: dict[str, list[int]] = {"cold": [], "base": []}
    while "base" not in {r for r, t in tokens.items() if len(t) == 6}:
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    assert tokens["cold"] == []  # still loading
    release.set()
    for (request_id, _), new in _run(engine).items():
        tokens[request_id] += new
    assert tokens["base"] == hf_greedy(hf, prompt, 6)
    assert tokens["cold"] == hf_greedy(adapters[2].reference, prompt, 6)


def test_base_steps_keep_the_decode_forward(checkpoint: tuple[Path, PreTrainedModel],
                                            adapters: list[Adapter]) -> None:
    """A runner with adapter slots runs decode steps as one C++ call, base-model steps without
    adapters and adapted steps with them (the prefill goes layer by layer): PEFT's tokens."""
    path, hf = checkpoint
    runner = make_runner(path)
    assert runner.decode_forward is not None and runner.lora is not None
    calls: list[LoraSlots | None] = []  # each call's adapters
    forward = runner.decode_forward

    class Counting:
        def can_run(self, batch: ForwardBatch, lora: LoraSlots | None = None) -> bool:
            return forward.can_run(batch, lora)

        def __call__(self, batch: ForwardBatch, lora: LoraSlots | None = None) -> torch.Tensor:
            calls.append(lora)
            return forward(batch, lora)

    runner.decode_forward = Counting()  # type: ignore[assignment]
    [prompt] = random_prompts([12], seed=9)
    base = Sequence("b", prompt, 5)
    PagedDriver(runner).run([base])
    assert calls == [None] * 4 and base.output == hf_greedy(hf, prompt, 5)
    calls.clear()
    adapted = Sequence("l", prompt, 5, lora=adapters[1].lora)
    PagedDriver(runner).run([adapted])
    assert calls == [runner.lora.slots] * 4
    assert adapted.output == hf_greedy(adapters[1].reference, prompt, 5)
    calls.clear()
    both = [Sequence("b2", prompt, 5), Sequence("l2", prompt, 5, lora=adapters[2].lora)]
    PagedDriver(runner).run(both)  # base and adapted rows in each decode step
    assert calls == [runner.lora.slots] * 4
    assert both[0].output == hf_greedy(hf, prompt, 5)
    assert both[1].output == hf_greedy(adapters[2].reference, prompt, 5)


def test_a_pinned_adapter_stays_on_the_host_until_a_request_unpins_it(
        checkpoint: tuple[Path, PreTrainedModel], adapters: list[Adapter]) -> None:
    """One adapter kept on the host (max_cpu_loras 1): the pinned one outlives the LRU, and
    goes the LRU's way once a request comes with it unpinned."""
    from engine.models.config import ModelConfig
    from engine.worker.lora_cache import LoraCache

    path, _ = checkpoint
    cache = LoraCache(ModelConfig.from_file(path), LoraConfig(max_loras=1, max_cpu_loras=1),
                      torch.device("cpu"), torch.float32)
    pinned = dataclasses.replace(adapters[0].lora, pinned=True)
    others = [adapters[1].lora, adapters[2].lora]

    def use(lora: LoraRequest) -> None:
        assert cache.prepare(lora).result(timeout=120) > 0
        cache.release(lora.name)

    for lora in (pinned, *others):
        use(lora)
        assert list(cache._host) == [pinned.name]  # the others come and go
    use(adapters[0].lora)  # unpinned by the registry since
    use(others[0])
    assert list(cache._host) == [others[0].name]
