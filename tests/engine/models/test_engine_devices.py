"""The whole engine on each device this machine has: greedy tokens equal HF transformers'.

On the CPU this runs everywhere. Where CUDA is present (the device check, ops/gpu_check.sh)
the same tests drive the CUDA path end to end: Triton attention, the fused add-norm, decode
steps replayed from CUDA graphs that read their inputs from static buffers filled by one copy
(engine.graph_inputs), async scheduling, the sampler's pinned copies and its penalty table,
and LoRA adapters through the Triton SGMV kernels.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from transformers import PreTrainedModel

from engine import LLMEngine, LoraConfig, SamplingParams
from engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from engine.worker.model_runner import TorchModelRunner
from tests.engine.models.helpers import hf_greedy, model_engine, random_prompts
from tests.engine.models.lora_adapters import Adapter, make_adapter

# The seed of this module's `llama` checkpoint (the fixture in tests/engine/conftest.py).
LLAMA_SEED = 21
DEVICES = ["cpu"] + (["cuda"] if torch.cuda.is_available() else [])


def _engine(path: Path, device: str, async_scheduling: bool) -> LLMEngine:
    return model_engine(path, num_kv_blocks=128, max_model_len=256, max_num_batched_tokens=48,
                        async_scheduling=async_scheduling, device=device)


def _run(engine: LLMEngine, requests: dict[str, tuple[list[int], SamplingParams]],
         ) -> dict[str, list[int]]:
    for request_id, (prompt, params) in requests.items():
        engine.add_request(request_id, prompt, params)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    return tokens


@pytest.mark.parametrize("async_scheduling", [False, True], ids=["sync", "async"])
@pytest.mark.parametrize("device", DEVICES)
def test_greedy_tokens_equal_hf(llama: tuple[Path, PreTrainedModel], device: str,
                                async_scheduling: bool) -> None:
    """Seven requests, one prompt longer than the token budget (chunked next to decodes);
    their lengths differ, so the decodes shrink through the graph sizes 8, 4, 2 and 1."""
    path, hf = llama
    hf = hf.to(device)
    engine = _engine(path, device, async_scheduling)
    lengths, outputs = [5, 40, 17, 1, 33, 60, 9], [14, 6, 20, 9, 3, 11, 17]
    prompts = random_prompts(lengths, seed=8)
    requests = {
        f"r{i}": (prompt, SamplingParams(temperature=0.0, max_tokens=n, ignore_eos=True))
        for i, (prompt, n) in enumerate(zip(prompts, outputs, strict=True))
    }
    tokens = _run(engine, requests)
    for request_id, (prompt, params) in requests.items():
        assert params.max_tokens is not None
        assert tokens[request_id] == hf_greedy(hf, prompt, params.max_tokens), request_id
    runner = engine.runner
    assert isinstance(runner, TorchModelRunner)
    if device == "cuda":
        assert runner.graphs is not None and runner.graphs.inputs.num_loads > 0


@pytest.mark.parametrize("device", DEVICES)
def test_every_sampling_feature_runs_and_seeds_hold_in_any_batch(
    llama: tuple[Path, PreTrainedModel], device: str
) -> None:
    """Penalties, seeds, top-k/top-p/min-p, logprobs and min_tokens in one batch, with async
    scheduling: every request ends with its tokens, and a seeded request samples the same
    tokens alone as among the others."""
    path, _ = llama
    prompts = random_prompts([12, 30, 7, 22, 15], seed=9)
    params = [
        SamplingParams(temperature=0.0, repetition_penalty=1.3, presence_penalty=0.4,
                       max_tokens=12, ignore_eos=True, logprobs=3),
        SamplingParams(temperature=0.9, top_k=20, top_p=0.9, seed=5, frequency_penalty=0.5,
                       max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=1.1, min_p=0.05, max_tokens=12, ignore_eos=True),
        SamplingParams(temperature=0.7, seed=11, max_tokens=12, min_tokens=12, logprobs=0,
                       stop_token_ids=[3]),
        SamplingParams(temperature=0.0, max_tokens=12, ignore_eos=True),
    ]
    crowded = _run(_engine(path, device, True),
                   {f"m{i}": (p, q) for i, (p, q) in enumerate(zip(prompts, params, strict=True))})
    assert all(len(t) == 12 for t in crowded.values())
    assert 3 not in crowded["m3"]  # min_tokens held its stop token back
    for index in (1, 3):  # the seeded ones, alone
        alone = _run(_engine(path, device, True), {"x": (prompts[index], params[index])})
        assert alone["x"] == crowded[f"m{index}"]


@pytest.mark.parametrize("device", DEVICES)
def test_adapters_and_the_base_model_in_one_engine_give_peft_tokens(
    llama: tuple[Path, PreTrainedModel], device: str, tmp_path: Path
) -> None:
    """Three adapters (ranks 8, 16 and 64, rsLoRA on one) and the base model in one engine with
    async scheduling and two adapter slots: on CUDA through the Triton shrink/expand kernels
    (engine.models.triton_lora), on the CPU through the C++ ones (engine.models.cpu_decode_lora),
    chunked prefills next to decodes, adapters waiting for slots;
    every request's greedy tokens are PEFT's on the same device."""
    path, hf = llama
    adapters = [make_adapter(path, tmp_path / "r8", 8, seed=1),
                make_adapter(path, tmp_path / "r16", 16, seed=2, use_rslora=True, alpha=8),
                make_adapter(path, tmp_path / "r64", 64, seed=3)]
    config = EngineConfig(
        SchedulerConfig(max_num_batched_tokens=48, max_num_seqs=8, max_model_len=256),
        async_scheduling=True,
        runner=RunnerConfig(num_kv_blocks=128, sampler_seed=0),
        lora=LoraConfig(max_loras=2, max_cpu_loras=4, max_lora_rank=64),
    )
    runner = TorchModelRunner.from_model_dir(path, config, device=device)
    engine = LLMEngine(config, runner)
    choices: list[Adapter | None] = [adapters[0], None, adapters[1], adapters[2], None,
                                     adapters[0], adapters[2]]
    prompts = random_prompts([5, 40, 17, 33, 9, 60, 12], seed=4)
    requests = {f"l{i}": (prompt, SamplingParams(temperature=0.0, max_tokens=10,
                                                  ignore_eos=True))
                for i, prompt in enumerate(prompts)}
    for (request_id, (prompt, params)), adapter in zip(requests.items(), choices, strict=True):
        engine.add_request(request_id, prompt, params,
                           lora=None if adapter is None else adapter.lora)
    tokens: dict[str, list[int]] = {request_id: [] for request_id in requests}
    while engine.has_unfinished_requests():
        for output in engine.step():
            tokens[output.request_id] += output.new_token_ids
    for (request_id, (prompt, _)), adapter in zip(requests.items(), choices, strict=True):
        reference = hf if adapter is None else adapter.reference
        assert tokens[request_id] == hf_greedy(reference.to(device), prompt, 10), request_id
    assert runner.lora is not None
    kernels = runner.lora.slots.kernels
    assert type(kernels).__name__ == ("TritonLoraStack" if device == "cuda" else "CpuLoraKernels")
