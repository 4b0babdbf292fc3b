"""Offline throughput benchmark: the engine (continuous batching, paged KV cache) on a workload
file, against HF transformers on identical weights and prompts: `generate` with static batches,
and HF's own continuous batching (`init_continuous_batching`, per-request max_new_tokens, the
same batch cap, token budget and KV cache bytes as the engine).

Everything arrives at t=0; each request generates exactly its output_len tokens (ignore_eos,
greedy), on a model config with seeded random float32 weights. Reported per system: output and
total (prompt + output) tokens per second, and achieved model GFLOP/s: engine.flops of the
useful work (every prompt and output token once, lm_head for output tokens only) divided by
wall time, the same count for both systems (with --shared-prefix, prompt tokens served from
the prefix cache still count as work). The machine's 2048^3 float32 matmul rate is the
yardstick. Each measurement runs in a fresh process, all with the same OpenMP wait policy
(passive unless asked otherwise), and the table ends with the machine's load average: on a
shared machine compare the ratios of one run, not absolute figures across runs. A seeded
script with a printed table; never a CI timing gate.

    python -m bench.offline --num-requests 64 --compare-hf
"""

from __future__ import annotations

import argparse
import contextlib
import json
import logging
import multiprocessing
import os
import sys
import time
from collections.abc import Iterator, Sequence
from concurrent.futures import ProcessPoolExecutor
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import torch

from bench.workload import BENCH_INPUTS, Workload, WorkloadRequest
from engine.config import EngineConfig, RunnerConfig, SchedulerConfig
from engine.core.llm_engine import LLMEngine
from engine.core.queues import FCFSQueue
from engine.models.config import ModelConfig
from engine.models.loader import random_hf_state_dict
from engine.sampling_params import SamplingParams
from engine.types import TenantContext
from engine.worker.flops import forward_flops
from engine.worker.model_runner import TorchModelRunner
from policies import TieredPolicy

if TYPE_CHECKING:  # transformers is a test/benchmark dependency, imported only when comparing
    from transformers.generation.continuous_batching import ContinuousBatchingManager

__all__ = [
    "BenchConfig",
    "BenchResult",
    "add_arguments",
    "format_table",
    "main",
    "matmul_gflops",
    "report",
    "run",
]

DEFAULT_WORKLOAD = BENCH_INPUTS / "workload-offline-200.json"
DEFAULT_MODEL = BENCH_INPUTS / "bench-model.json"
_PRIORITIES = {"premium": 0, "standard": 1, "batch": 2}
_HF_RESULT_TIMEOUT_S = 600.0  # longest wait for one HF result before calling the run stalled


@dataclass
class BenchConfig:
    """What to run and how."""

    workload: Path = DEFAULT_WORKLOAD  # workload file (ops/bench/inputs format)
    model_config: Path = DEFAULT_MODEL  # HF config.json of the model, weights are random
    num_requests: int = 64  # first N requests of the workload
    max_num_seqs: int = 32  # batch cap (the engine's running requests, HF's static batch)
    max_num_batched_tokens: int = 2048  # the engine's token budget per step (engine default)
    kv_cache_bytes: int = 1 << 30  # the engine's KV cache
    seed: int = 0  # weights seed; prompts come from the workload's own seed
    shared_prefix: bool = False  # use the workload's shared prefixes (README figures: off)
    compare_hf: bool = False  # also run HF transformers static and continuous batching
    num_threads: int | None = None  # torch intra-op threads; None: one per available core
    # OMP_WAIT_POLICY of every measured process. "passive": an idle OpenMP worker sleeps at
    # once. libgomp's default spins first, which on a shared machine with few cores burns the
    # time slices the other thread needs (the engine ran several times slower on a loaded
    # host); "default" leaves the variable as the environment has it.
    omp_wait_policy: str = "passive"
    device: str = "cpu"  # where the engine and HF run ("cuda" on a GPU machine)
    dtype: str = "float32"  # weights, activations and KV cache of both


@dataclass
class BenchResult:
    """One system's run over the workload."""

    system: str
    num_requests: int
    num_prompt_tokens: int
    num_output_tokens: int
    elapsed_s: float
    model_gflop: float  # useful model work, engine.flops
    num_steps: int  # engine steps, or HF generate calls

    @property
    def output_tokens_per_s(self) -> float:
        return self.num_output_tokens / self.elapsed_s

    @property
    def total_tokens_per_s(self) -> float:
        return (self.num_prompt_tokens + self.num_output_tokens) / self.elapsed_s

    @property
    def gflops(self) -> float:
        return self.model_gflop / self.elapsed_s


def matmul_gflops(size: int = 2048, repeats: int = 5, device: str = "cpu",
                  dtype: torch.dtype = torch.float32) -> float:
    """Best-of-repeats size^3 matrix product rate on the device, GFLOP/s."""
    generator = torch.Generator().manual_seed(0)
    a = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    b = torch.randn(size, size, generator=generator).to(device=device, dtype=dtype)
    torch.mm(a, b)
    best = float("inf")
    for _ in range(repeats):
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        started = time.perf_counter()
        torch.mm(a, b)
        if device.startswith("cuda"):
            torch.cuda.synchronize()
        best = min(best, time.perf_counter() - started)
    return 2 * size**3 / best / 1e9


def _dtype(bench: BenchConfig) -> torch.dtype:
    dtype = getattr(torch, bench.dtype)
    assert isinstance(dtype, torch.dtype), bench.dtype
    return dtype


def _synchronize(bench: BenchConfig) -> None:
    """Wait for the device's queued work, so that the clock read next ends the run."""
    if bench.device.startswith("cuda"):
        torch.cuda.synchronize()


def _useful_gflop(config: ModelConfig, requests: list[WorkloadRequest]) -> float:
    total = 0.0
    for r in requests:
        num_tokens = r.prompt_len + r.output_len - 1  # the last output token is never fed back
        total += forward_flops(config, num_tokens, num_tokens, r.output_len)
    return total / 1e9


def run_engine(
    bench: BenchConfig, config: ModelConfig, requests: list[WorkloadRequest],
    prompts: dict[str, list[int]],
) -> BenchResult:
    max_model_len = max(r.prompt_len + r.output_len for r in requests) + 16
    engine_config = EngineConfig(
        scheduler=SchedulerConfig(
            max_num_batched_tokens=bench.max_num_batched_tokens,
            max_num_seqs=bench.max_num_seqs,
            max_model_len=max_model_len,
        ),
        runner=RunnerConfig(kv_cache_bytes=bench.kv_cache_bytes),
    )
    runner = TorchModelRunner.from_random(
        config, bench.seed, engine_config, dtype=_dtype(bench), device=bench.device
    )
    # Tiers by priority, in arrival order: what the engine did by default before its policy
    # became a choice of its own (FCFS now), so earlier runs compare.
    engine = LLMEngine(engine_config, runner, TieredPolicy(FCFSQueue()))
    _drain(engine, {"warmup": [3] * 64}, {"warmup": 4}, {})  # threads, allocator, first step
    lengths = {r.request_id: r.output_len for r in requests}
    tenants = {
        r.request_id: TenantContext(r.tenant, r.tier, _PRIORITIES.get(r.tier, 1),
                                    cache_salt=r.tenant)
        for r in requests
    }
    started = time.perf_counter()
    num_output, num_steps = _drain(engine, prompts, lengths, tenants)
    _synchronize(bench)
    elapsed = time.perf_counter() - started
    return BenchResult(
        "tiergate engine", len(requests), sum(r.prompt_len for r in requests), num_output,
        elapsed, _useful_gflop(config, requests), num_steps,
    )


def _drain(
    engine: LLMEngine,
    prompts: dict[str, list[int]],
    lengths: dict[str, int],
    tenants: dict[str, TenantContext],
) -> tuple[int, int]:
    """Add every request at once and step until all finish; returns output tokens, steps."""
    for request_id, prompt in prompts.items():
        params = SamplingParams(temperature=0.0, max_tokens=lengths[request_id], ignore_eos=True)
        engine.add_request(request_id, prompt, params, tenants.get(request_id))
    num_output = num_steps = 0
    while engine.has_unfinished_requests():
        num_steps += 1
        for output in engine.step():
            if output.error:
                raise RuntimeError(f"request {output.request_id} failed: {output.error}")
            num_output += len(output.new_token_ids)
    return num_output, num_steps


def _hf_model(bench: BenchConfig, config: ModelConfig) -> Any:
    """The HF model of the config with the engine's random weights, EOS ignored (a
    transformers PreTrainedModel; typed Any as transformers' generate mixins do not type-check)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    raw = json.loads(bench.model_config.read_text())
    hf_config = AutoConfig.for_model(raw.pop("model_type"), **raw)
    model = AutoModelForCausalLM.from_config(hf_config, dtype=torch.float32).eval()
    model.load_state_dict(random_hf_state_dict(config, bench.seed))
    model = model.to(device=bench.device, dtype=_dtype(bench))
    model.generation_config.eos_token_id = None  # ignore_eos
    return model


def run_hf_static(
    bench: BenchConfig, config: ModelConfig, requests: list[WorkloadRequest],
    prompts: dict[str, list[int]],
) -> BenchResult:
    """HF generate on batches of max_num_seqs in workload order: left padding, every batch runs
    to its longest output (the padding's extra tokens are not counted as output)."""
    model = _hf_model(bench, config)
    pad_id = 0
    with torch.inference_mode():
        model.generate(torch.tensor([[3] * 64], device=bench.device), max_new_tokens=4,
                       do_sample=False, pad_token_id=pad_id)  # warm-up
        _synchronize(bench)
        started = time.perf_counter()
        num_batches = 0
        for first in range(0, len(requests), bench.max_num_seqs):
            num_batches += 1
            batch = requests[first : first + bench.max_num_seqs]
            longest = max(r.prompt_len for r in batch)
            ids = torch.full((len(batch), longest), pad_id, dtype=torch.int64)
            mask = torch.zeros((len(batch), longest), dtype=torch.int64)
            for row, r in enumerate(batch):
                ids[row, longest - r.prompt_len :] = torch.tensor(prompts[r.request_id])
                mask[row, longest - r.prompt_len :] = 1
            model.generate(ids.to(bench.device), attention_mask=mask.to(bench.device),
                           do_sample=False, pad_token_id=pad_id,
                           max_new_tokens=max(r.output_len for r in batch))
        _synchronize(bench)
        elapsed = time.perf_counter() - started
    return BenchResult(
        "HF generate, static batches", len(requests), sum(r.prompt_len for r in requests),
        sum(r.output_len for r in requests), elapsed, _useful_gflop(config, requests),
        num_batches,
    )


def run_hf_continuous(
    bench: BenchConfig, config: ModelConfig, requests: list[WorkloadRequest],
    prompts: dict[str, list[int]],
) -> BenchResult:
    """HF continuous batching: every request added at once with its own max_new_tokens, at most
    max_num_seqs per batch under the engine's token budget, a KV cache of the engine's bytes."""
    from transformers import ContinuousBatchingConfig, GenerationConfig

    model = _hf_model(bench, config)
    page_size = 256  # HF's default page
    element_size = torch.empty(0, dtype=_dtype(bench)).element_size()
    bytes_per_page = 2 * config.num_layers * page_size * config.kv_size * element_size  # K, V
    cb_config = ContinuousBatchingConfig(
        page_size=page_size,
        num_blocks=max(1, bench.kv_cache_bytes // bytes_per_page),
        max_batch_tokens=bench.max_num_batched_tokens,
        max_requests_per_batch=bench.max_num_seqs,
    )
    generation = GenerationConfig(do_sample=False, eos_token_id=None, pad_token_id=0,
                                  max_new_tokens=4)
    # Without psutil HF logs an error that it cannot size a CPU cache; num_blocks sizes it.
    logging.getLogger("ContinuousBatchingLogger").setLevel(logging.CRITICAL)
    with model.continuous_batching_context_manager(
        generation_config=generation, continuous_batching_config=cb_config, block=True,
        timeout=10,
    ) as manager:
        _hf_collect(manager, {"warmup": [3] * 64}, {"warmup": 4})
        started = time.perf_counter()
        num_output = _hf_collect(
            manager, {r.request_id: prompts[r.request_id] for r in requests},
            {r.request_id: r.output_len for r in requests},
        )
        elapsed = time.perf_counter() - started
    return BenchResult(
        "HF continuous batching", len(requests), sum(r.prompt_len for r in requests),
        num_output, elapsed, _useful_gflop(config, requests), len(requests),
    )


def _hf_collect(
    manager: ContinuousBatchingManager, prompts: dict[str, list[int]], lengths: dict[str, int]
) -> int:
    """Add every request, wait for all to finish; returns their output tokens."""
    for request_id, prompt in prompts.items():
        manager.add_request(prompt, request_id=request_id, max_new_tokens=lengths[request_id])
    num_output = 0
    pending = set(prompts)
    while pending:
        result = manager.get_result(timeout=_HF_RESULT_TIMEOUT_S)
        if result is None:
            raise RuntimeError(f"HF continuous batching stalled with {len(pending)} requests left")
        if result.error:
            raise RuntimeError(f"HF request {result.request_id} failed: {result.error}")
        if result.is_finished() and result.request_id in pending:
            pending.discard(result.request_id)
            if len(result.generated_tokens) != lengths[result.request_id]:
                raise RuntimeError(f"HF request {result.request_id} stopped early")
            num_output += len(result.generated_tokens)
    return num_output


def _measure(system: str, bench: BenchConfig) -> BenchResult | float:
    """One measurement, run in a fresh process by `run`."""
    torch.set_num_threads(bench.num_threads or len(os.sched_getaffinity(0)))
    if system == "matmul":
        return matmul_gflops(device=bench.device, dtype=_dtype(bench))
    config = ModelConfig.from_file(bench.model_config)
    workload = Workload.load(bench.workload, limit=bench.num_requests)
    prompts = workload.prompts(config.vocab_size, use_shared_prefix=bench.shared_prefix)
    measure = {"engine": run_engine, "hf": run_hf_static, "hf-cb": run_hf_continuous}[system]
    return measure(bench, config, workload.requests, prompts)


def run(bench: BenchConfig) -> tuple[list[BenchResult], float]:
    """Run the engine (and HF when asked); returns the results and the matmul GFLOP/s.

    Each measurement gets a fresh process: what one leaves behind must not slow or speed up
    another (the engine's runner tunes glibc's allocator process-wide; a big MKL matmul run
    first measurably slowed the engine after it).
    """
    systems = ["engine", "hf", "hf-cb", "matmul"] if bench.compare_hf else ["engine", "matmul"]
    context = multiprocessing.get_context("spawn")
    measured = []
    with _child_environment(bench.omp_wait_policy):
        for system in systems:
            with ProcessPoolExecutor(max_workers=1, mp_context=context) as pool:
                measured.append(pool.submit(_measure, system, bench).result())
    *results, peak = measured
    assert isinstance(peak, float) and all(isinstance(r, BenchResult) for r in results)
    return [r for r in results if isinstance(r, BenchResult)], peak


@contextlib.contextmanager
def _child_environment(omp_wait_policy: str) -> Iterator[None]:
    """OMP_WAIT_POLICY for the processes started inside (OpenMP reads it when torch loads, so
    setting it here changes nothing in this process)."""
    previous = os.environ.get("OMP_WAIT_POLICY")
    if omp_wait_policy != "default":
        os.environ["OMP_WAIT_POLICY"] = omp_wait_policy.upper()
    try:
        yield
    finally:
        if previous is None:
            os.environ.pop("OMP_WAIT_POLICY", None)
        else:
            os.environ["OMP_WAIT_POLICY"] = previous


def format_table(results: list[BenchResult], matmul: float, device: str = "cpu",
                 dtype: str = "float32") -> str:
    lines = [
        f"{'system':30} {'output tok/s':>12} {'total tok/s':>12} {'GFLOP/s':>8} "
        f"{'% matmul':>8} {'time s':>8} {'steps':>6}"
    ]
    for r in results:
        lines.append(
            f"{r.system:30} {r.output_tokens_per_s:12.1f} {r.total_tokens_per_s:12.1f} "
            f"{r.gflops:8.1f} {100 * r.gflops / matmul:8.1f} {r.elapsed_s:8.1f} {r.num_steps:6d}"
        )
    lines.append(f"{dtype} 2048^3 matmul on this machine's {device}: {matmul:.1f} GFLOP/s")
    for other in results[1:]:
        ratio = results[0].output_tokens_per_s / other.output_tokens_per_s
        lines.append(f"engine / {other.system}: {ratio:.2f}x output tokens/s")
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    """The benchmark's options (shared by `tiergate bench offline` and `python -m`)."""
    d = BenchConfig()
    parser.add_argument("--workload", type=Path, default=d.workload)
    parser.add_argument("--model-config", type=Path, default=d.model_config)
    parser.add_argument("--num-requests", type=int, default=d.num_requests)
    parser.add_argument("--max-num-seqs", type=int, default=d.max_num_seqs)
    parser.add_argument("--max-num-batched-tokens", type=int, default=d.max_num_batched_tokens)
    parser.add_argument("--seed", type=int, default=d.seed)
    parser.add_argument("--shared-prefix", action="store_true",
                        help="use the workload's shared prefixes (default: fully random prompts)")
    parser.add_argument("--compare-hf", action="store_true",
                        help="also run HF transformers: static batches and continuous batching")
    parser.add_argument("--threads", type=int, default=None, help="torch threads (default: cores)")
    parser.add_argument("--omp-wait-policy", choices=["passive", "active", "default"],
                        default=d.omp_wait_policy,
                        help="OMP_WAIT_POLICY of the measured processes (default: passive)")
    parser.add_argument("--device", default=d.device,
                        help="device of the engine and HF (default: cpu; cuda on a GPU)")
    parser.add_argument("--dtype", default=d.dtype, choices=["float32", "bfloat16", "float16"],
                        help="weights and KV cache dtype of both (default: float32)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def config_from_args(args: argparse.Namespace) -> BenchConfig:
    return BenchConfig(
        workload=args.workload,
        model_config=args.model_config,
        num_requests=args.num_requests,
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=args.max_num_batched_tokens,
        seed=args.seed,
        shared_prefix=args.shared_prefix,
        compare_hf=args.compare_hf,
        num_threads=args.threads,
        omp_wait_policy=args.omp_wait_policy,
        device=args.device,
        dtype=args.dtype,
    )


def report(args: argparse.Namespace) -> int:
    """Run from parsed arguments and print the table (or JSON), with the machine's load."""
    bench = config_from_args(args)
    load_before = os.getloadavg()[0]
    results, matmul = run(bench)
    load_after = os.getloadavg()[0]
    if args.json:
        rows = [
            asdict(r) | {"output_tokens_per_s": r.output_tokens_per_s,
                         "total_tokens_per_s": r.total_tokens_per_s, "gflops": r.gflops}
            for r in results
        ]
        print(json.dumps({"results": rows, "matmul_gflops": matmul,
                          "load_average_1m": [load_before, load_after],
                          "omp_wait_policy": bench.omp_wait_policy}, indent=2))
    else:
        print(format_table(results, matmul, bench.device, bench.dtype))
        print(f"load average (1 min) before / after: {load_before:.2f} / {load_after:.2f}; "
              f"OMP_WAIT_POLICY {bench.omp_wait_policy}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Offline throughput: engine vs HF generate")
    add_arguments(parser)
    return report(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
