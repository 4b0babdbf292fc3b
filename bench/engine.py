"""`tiergate bench engine`: the engine's own host work per step, without model work.

The engine runs on engine.testing.NoWorkRunner: every step is scheduled, its inputs
are built as the real runner builds them, outputs are processed and metered, but no forward
runs (one constant token is "sampled"). Two measurements:

- decode steps: N requests with contexts of --context tokens all decoding (1, 32, 128 and 256
  by default); microseconds per step and per running request, median of --repeats runs of
  --steps steps each;
- short requests: --short-requests requests of a 4-token prompt and one output token arrive
  together and run to their final output; microseconds of host work per request (adding,
  prefilling, sampling, finishing, delivering its outputs).

With `--device DEV` (cuda on a GPU machine) it also runs a real model (`--model-config`,
random weights in `--dtype`) on DEV: the engine step against the forward alone and the
bytes a decode step reads against the device's copy rate (bench.device), and with
`--compare-hf` the offline throughput against HF transformers `generate` on the same weights
(bench.offline, `--offline-requests` requests of its workload, cycled).

A third table times the real sampler's host work per step (bench.sampler), which the
no-work runner leaves out, at the same batch sizes.

Never a CI gate: the figures depend on the machine. `--json` prints the rows as JSON.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from collections.abc import Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from bench import sampler as bench_sampler
from bench.offline import DEFAULT_MODEL
from engine.config import CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig
from engine.core.llm_engine import LLMEngine
from engine.core.request import Request
from engine.sampling_params import SamplingParams
from engine.testing.no_work_runner import NoWorkRunner
from engine.types import TenantContext
from policies import TieredPolicy

__all__ = [
    "DecodeRow",
    "ShortRow",
    "add_arguments",
    "measure_decode",
    "measure_short",
    "report",
    "step_until_decoding",
]

_BLOCK_SIZE = 16
_MAX_MODEL_LEN = 4096
POLICIES = ("fcfs", "tiered")
# --policy tiered: request i belongs to tenant i % 4, in three tiers.
_TENANTS = (
    TenantContext("t0", "premium", 0),
    TenantContext("t1", "standard", 1),
    TenantContext("t2", "standard", 1),
    TenantContext("t3", "batch", 2),
)


@dataclass
class DecodeRow:
    num_running: int
    step_us: float  # median over the repeats
    per_request_us: float
    step_us_min: float
    step_us_max: float


@dataclass
class ShortRow:
    num_requests: int
    per_request_us: float  # median over the repeats
    per_request_us_min: float
    per_request_us_max: float


def _engine(num_seqs: int, context: int, async_scheduling: bool, policy: str = "fcfs"
            ) -> LLMEngine:
    if policy not in POLICIES:
        raise ValueError(f"unknown policy {policy!r}: one of {', '.join(POLICIES)}")
    blocks_per_request = -(-(context + 512) // _BLOCK_SIZE)
    config = EngineConfig(
        SchedulerConfig(
            # every prompt in one step: the decodes start together, at the same context
            max_num_batched_tokens=max(2048, num_seqs * context),
            max_num_seqs=num_seqs,
            max_model_len=_MAX_MODEL_LEN,
        ),
        CacheConfig(block_size=_BLOCK_SIZE),
        async_scheduling=async_scheduling,
        runner=RunnerConfig(num_kv_blocks=num_seqs * blocks_per_request + 16),
    )
    return LLMEngine(config, NoWorkRunner(config), TieredPolicy() if policy == "tiered" else None)


def _tenant(index: int, policy: str) -> TenantContext | None:
    return _TENANTS[index % len(_TENANTS)] if policy == "tiered" else None


def measure_decode(num_running: int, context: int, num_steps: int, seed: int,
                   async_scheduling: bool = False, policy: str = "fcfs") -> float:
    """Seconds per decode step with num_running requests past their prompts; policy: the
    engine's FCFS policy, or the tiered policy over four tenants in three tiers."""
    engine = _engine(num_running, context, async_scheduling, policy)
    rng = random.Random(seed)
    params = SamplingParams(max_tokens=num_steps + 64, ignore_eos=True, temperature=0.0)
    for index in range(num_running):
        prompt = [rng.randrange(3, 32000) for _ in range(context - 1)]
        engine.add_request(f"d{index}", prompt, params, _tenant(index, policy))
    running = step_until_decoding(engine, num_running)
    started = time.perf_counter()
    for _ in range(num_steps):
        engine.step()
    elapsed = time.perf_counter() - started
    assert len(running) == num_running, "a request left during the measured steps"
    return elapsed / num_steps


def step_until_decoding(engine: LLMEngine, num_running: int) -> list[Request]:
    """Step until num_running requests run, every one past its prompt; the running list."""
    running = engine.scheduler.running
    while len(running) < num_running or any(not r.is_prefill_done for r in running):
        engine.step()
    return running


def measure_short(num_requests: int, seed: int, async_scheduling: bool = False,
                  policy: str = "fcfs") -> float:
    """Seconds of host work per request for num_requests one-token requests arriving
    together, from add_request to each one's final output."""
    engine = _engine(num_requests, 16, async_scheduling, policy)
    rng = random.Random(seed)
    prompts = [[rng.randrange(3, 32000) for _ in range(4)] for _ in range(num_requests)]
    params = SamplingParams(max_tokens=1, ignore_eos=True, temperature=0.0)
    finished = 0
    started = time.perf_counter()
    for index, prompt in enumerate(prompts):
        engine.add_request(f"s{index}", prompt, params, _tenant(index, policy))
    while engine.has_unfinished_requests():
        finished += len(engine.step().ends)  # the rows that end a sample
    elapsed = time.perf_counter() - started
    assert finished == num_requests
    return elapsed / num_requests


def run(
    batches: Sequence[int], context: int, num_steps: int, num_short: int, repeats: int, seed: int,
    async_scheduling: bool = False, policy: str = "fcfs",
) -> tuple[list[DecodeRow], ShortRow]:
    measure_short(num_short, seed, async_scheduling, policy)  # warm-up: imports, allocator
    decode_rows = []
    for num_running in batches:
        times = [measure_decode(num_running, context, num_steps, seed + r, async_scheduling,
                                policy)
                 for r in range(repeats)]
        step_us = statistics.median(times) * 1e6
        decode_rows.append(
            DecodeRow(num_running, step_us, step_us / num_running, min(times) * 1e6,
                      max(times) * 1e6)
        )
    short = [measure_short(num_short, seed + r, async_scheduling, policy) * 1e6
             for r in range(repeats)]
    return decode_rows, ShortRow(num_short, statistics.median(short), min(short), max(short))


def format_table(decode: list[DecodeRow], short: ShortRow, context: int, repeats: int,
                 async_scheduling: bool = False, policy: str = "fcfs") -> str:
    mode = "async" if async_scheduling else "synchronous"
    lines = [
        f"Engine host work per step, no model work (NoWorkRunner), {context}-token contexts,"
        f" {mode} scheduling, {policy} policy, median of {repeats}"
        " (min-max)",
        "",
        "| running decodes | us per step | us per running request |",
        "|---|---|---|",
    ]
    for row in decode:
        lines.append(
            f"| {row.num_running} | {row.step_us:.0f} ({row.step_us_min:.0f}-"
            f"{row.step_us_max:.0f}) | {row.per_request_us:.2f} |"
        )
    lines += [
        "",
        "| short requests arriving together (4-token prompt, 1 output) | us per request |",
        "|---|---|",
        f"| {short.num_requests} | {short.per_request_us:.0f} ({short.per_request_us_min:.0f}-"
        f"{short.per_request_us_max:.0f}) |",
    ]
    return "\n".join(lines)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--batches", type=int, nargs="+", default=[1, 32, 128, 256],
                        help="running decodes to measure (default: 1 32 128 256)")
    parser.add_argument("--context", type=int, default=1024,
                        help="tokens of each decoding request's context (default: 1024)")
    parser.add_argument("--steps", type=int, default=50, help="decode steps timed per run")
    parser.add_argument("--short-requests", type=int, default=32,
                        help="one-token requests arriving together (default: 32)")
    parser.add_argument("--repeats", type=int, default=5, help="runs per figure (median)")
    parser.add_argument("--seed", type=int, default=0, help="seed of the prompts")
    parser.add_argument("--async-scheduling", action="store_true",
                        help="host work with async scheduling (the next step queued before "
                             "the previous one's output is processed)")
    parser.add_argument("--policy", choices=POLICIES, default="fcfs",
                        help="the engine's FCFS policy, or the tiered policy with the requests "
                             "spread over four tenants in three tiers (default: fcfs)")
    parser.add_argument("--device", default=None,
                        help="also measure a real model on this device (cuda on a GPU machine)")
    parser.add_argument("--model-config", type=Path, default=DEFAULT_MODEL,
                        help="HF config.json of the device measurement's model (random weights)")
    parser.add_argument("--dtype", default="bfloat16", choices=["float32", "bfloat16", "float16"],
                        help="the device measurement's dtype (default: bfloat16)")
    parser.add_argument("--device-steps", type=int, default=60,
                        help="decode steps per device row (a third timed with async "
                             "scheduling, a third synchronous, a third forward only)")
    parser.add_argument("--copy-bytes", type=int, default=1 << 30,
                        help="bytes of the copy that measures the device's rate (default: 1 GiB)")
    parser.add_argument("--compare-hf", action="store_true",
                        help="with --device: offline throughput against HF generate")
    parser.add_argument("--offline-requests", type=int, default=256,
                        help="requests of the offline workload (cycled) for --compare-hf")
    parser.add_argument("--offline-max-num-seqs", type=int, default=64,
                        help="the engine's batch cap and HF's static batch for --compare-hf")
    parser.add_argument("--json", action="store_true", help="print JSON instead of a table")


def _device_report(args: argparse.Namespace) -> dict[str, Any]:
    """The device half: rows of bench.device, and the offline comparison if asked."""
    import torch

    from bench import device as bench_device
    from bench import offline as bench_offline
    from engine.models.config import ModelConfig
    from engine.models.loader import random_model

    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    config = ModelConfig.from_file(args.model_config)
    rate = bench_device.copy_rate(device, args.copy_bytes)
    model = None
    if device.type == "cuda":  # one random model for every row (an 8B one takes a minute)
        model = random_model(config, args.seed, dtype, device,
                             bench_device.max_model_len(args.context, args.device_steps))
    rows = [
        bench_device.measure_device(config, device, dtype, n, args.context, args.device_steps,
                                    rate, args.seed, model)
        for n in args.batches
    ]
    del model
    result: dict[str, Any] = {
        "rows": rows,
        "table": bench_device.format_device_table(rows, args.device, args.dtype, args.context,
                                                  rate),
        "copy_rate_bytes_per_s": rate,
    }
    if args.compare_hf:
        bench = bench_offline.BenchConfig(
            model_config=args.model_config, num_requests=args.offline_requests,
            max_num_seqs=args.offline_max_num_seqs, seed=args.seed, compare_hf=True,
            device=args.device, dtype=args.dtype,
        )
        offline, matmul = bench_offline.run(bench)
        result["offline"] = offline
        result["offline_table"] = bench_offline.format_table(offline, matmul, args.device,
                                                             args.dtype)
    return result


def report(args: argparse.Namespace) -> int:
    load_before = os.getloadavg()[0]
    decode, short = run(args.batches, args.context, args.steps, args.short_requests,
                        args.repeats, args.seed, args.async_scheduling, args.policy)
    sampler = bench_sampler.run(args.batches, args.steps, args.repeats, args.seed)
    device = _device_report(args) if args.device else None
    load_after = os.getloadavg()[0]
    if args.json:
        out: dict[str, Any] = {
            "decode": [asdict(r) for r in decode], "short": asdict(short),
            "sampler": [asdict(r) for r in sampler],
            "context": args.context, "repeats": args.repeats,
            "async_scheduling": args.async_scheduling,
            "policy": args.policy,
            "load_average_1m": [load_before, load_after],
        }
        if device is not None:
            out["device"] = {
                "name": args.device, "dtype": args.dtype,
                "copy_rate_bytes_per_s": device["copy_rate_bytes_per_s"],
                "rows": [asdict(r) for r in device["rows"]],
                "offline": [asdict(r) for r in device.get("offline", [])],
            }
        print(json.dumps(out, indent=2))
    else:
        print(format_table(decode, short, args.context, args.repeats,
                           args.async_scheduling, args.policy))
        print()
        print(bench_sampler.format_table(sampler, args.repeats))
        if device is not None:
            print()
            print(device["table"])
            if "offline_table" in device:
                print()
                print(device["offline_table"])
        print(f"load average (1 min) before / after: {load_before:.2f} / {load_after:.2f}")
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    return report(parser.parse_args(argv))


if __name__ == "__main__":
    sys.exit(main())
