"""Can a tenant cycling through cold LoRA adapters push a premium tenant out of its TTFT SLO?

    python -m ops.bench.lora_isolation [--seconds 60] [--seed 0] [--quick]

The default model (SmolLM2-135M-Instruct, float32, the CPU) in one `LLMEngine` with the tiered
policy and 4 adapter slots, 8 adapters kept on the host, on the real clock:

- a premium tenant sends a request every second on average (Poisson; 64 prompt tokens, 16
  output tokens) on one hot adapter;
- a standard tenant keeps 4 requests in flight (64 + 32 tokens), each on the next of 50 cold
  rank-16 adapters (all seven projections): every request of it loads an adapter the host
  does not hold (20 MB read, checked and fused) and takes a slot from another.

The same run is repeated with the standard tenant on the base model (nothing to load, no
slot to take): the control. Rows: premium TTFT p50 and p99, the share of premium requests
within the premium tier's TTFT SLO (0.5 s), the standard tenant's output tokens/s. Runs
alternate (control first, then the cold-adapter run, `--repeats` times), each on fresh
prompts. --quick: a smoke run of 6 s, 4 cold adapters.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from engine import LLMEngine, LoraConfig, LoraRequest, SamplingParams, TenantContext
from engine.config import CacheConfig, EngineConfig, RunnerConfig, SchedulerConfig
from engine.models.config import ModelConfig
from engine.worker.model_runner import TorchModelRunner
from gateway.server.model_source import default_model_file, gguf_model_dir
from gateway.server.settings import GatewaySettings
from ops.bench.lora_throughput import link_adapter, write_adapter
from policies import TieredPolicy, TierTable

PROMPT_TOKENS = 64
PREMIUM_OUTPUT, STANDARD_OUTPUT = 16, 32
PREMIUM_INTERVAL_S = 1.0
STANDARD_IN_FLIGHT = 4


@dataclass
class Result:
    ttfts: list[float]  # premium requests' TTFT, seconds
    standard_tokens_per_s: float


def make_engine(model_dir: Path, tiers: TierTable) -> LLMEngine:
    config = EngineConfig(
        SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=32, max_model_len=256),
        CacheConfig(block_size=16, reserved_fractions=tiers.reserved_fractions()),
        runner=RunnerConfig(num_kv_blocks=32 * 8 + 16, sampler_seed=0),
        lora=LoraConfig(max_loras=4, max_cpu_loras=8, max_lora_rank=16),
    )
    return LLMEngine(config, TorchModelRunner.from_model_dir(model_dir, config), TieredPolicy())


def run(engine: LLMEngine, tiers: TierTable, seconds: float, hot: LoraRequest,
        cold: list[LoraRequest] | None, vocab: int, rng: random.Random) -> Result:
    """Premium arrivals on hot for `seconds`, the standard tenant on the cold adapters in turn
    (None: on the base model) throughout; then the engine is drained."""
    premium = TenantContext("premium-tenant", "premium", tiers["premium"].priority,
                            cache_salt="p")
    standard = TenantContext("standard-tenant", "standard", tiers["standard"].priority,
                             cache_salt="s")

    def prompt() -> list[int]:
        return [rng.randrange(1000, vocab) for _ in range(PROMPT_TOKENS)]

    premium_params = SamplingParams(temperature=0.0, max_tokens=PREMIUM_OUTPUT, ignore_eos=True)
    standard_params = SamplingParams(temperature=0.0, max_tokens=STANDARD_OUTPUT,
                                     ignore_eos=True)
    started = time.monotonic()
    next_premium = started + rng.expovariate(1 / PREMIUM_INTERVAL_S)
    arrivals: dict[str, float] = {}
    ttfts: list[float] = []
    standard_open: set[str] = set()
    standard_tokens = 0
    count = 0
    while True:
        now = time.monotonic()
        running = now - started < seconds
        while running and next_premium <= now:
            request_id = f"p{count}"
            engine.add_request(request_id, prompt(), premium_params, premium, lora=hot)
            arrivals[request_id] = next_premium
            next_premium += rng.expovariate(1 / PREMIUM_INTERVAL_S)
            count += 1
        while running and len(standard_open) < STANDARD_IN_FLIGHT:
            request_id = f"s{count}"
            lora = None if cold is None else cold[count % len(cold)]
            engine.add_request(request_id, prompt(), standard_params, standard, lora=lora)
            standard_open.add(request_id)
            count += 1
        if not running and not engine.has_unfinished_requests():
            break
        for output in engine.step():
            if output.request_id in arrivals and output.new_token_ids:
                ttfts.append(time.monotonic() - arrivals.pop(output.request_id))
            if output.request_id in standard_open:
                if running:
                    standard_tokens += len(output.new_token_ids)
                if output.finished:
                    standard_open.discard(output.request_id)
    assert not arrivals, "a premium request never produced a token"
    return Result(ttfts, standard_tokens / seconds)


def _p(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seconds", type=float, default=60.0)
    parser.add_argument("--repeats", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    seconds, num_cold, repeats = (6.0, 4, 1) if args.quick else (args.seconds, 50, args.repeats)
    cache_dir = Path(GatewaySettings().model_cache_dir)
    model_dir = gguf_model_dir(default_model_file(cache_dir), cache_dir, torch.float32)
    config = ModelConfig.from_dict(json.loads((model_dir / "config.json").read_text()))
    tiers = TierTable()
    slo = tiers["premium"].ttft_slo_s
    assert slo is not None
    rng = random.Random(args.seed)
    with tempfile.TemporaryDirectory(prefix="lora-isolation-") as scratch:
        root = Path(scratch)
        write_adapter(root / "hot", config, 16, seed=args.seed)
        hot = LoraRequest("hot", str(root / "hot"))
        write_adapter(root / "cold-source", config, 16, seed=args.seed + 1)
        cold = []
        for index in range(num_cold):  # distinct names: each is loaded on its own
            link_adapter(root / "cold-source", root / f"cold-{index}")
            cold.append(LoraRequest(f"cold-{index}", str(root / f"cold-{index}")))
        engine = make_engine(model_dir, tiers)
        run(engine, tiers, 2.0, hot, None, config.vocab_size, rng)  # warm-up
        print(f"LoRA isolation: {model_dir.name}, float32 CPU, {torch.get_num_threads()} "
              f"threads; {seconds:.0f} s a run; premium: a request every "
              f"{PREMIUM_INTERVAL_S} s on a hot adapter ({PROMPT_TOKENS} + {PREMIUM_OUTPUT} "
              f"tokens); standard: {STANDARD_IN_FLIGHT} in flight ({PROMPT_TOKENS} + "
              f"{STANDARD_OUTPUT} tokens); 4 slots, 8 on the host; premium TTFT SLO {slo} s")
        print("| run | standard tenant on | premium requests | TTFT p50 (s) | TTFT p99 (s) | "
              "within SLO | standard out tok/s |")
        print("|---|---|---|---|---|---|---|")
        attained: dict[str, list[float]] = {"base": [], "cold": []}
        for repeat in range(repeats):
            for name, loras in (("base", None), ("cold", cold)):
                result = run(engine, tiers, seconds, hot, loras, config.vocab_size, rng)
                within = sum(t <= slo for t in result.ttfts) / len(result.ttfts)
                attained[name].append(within)
                label = ("the base model" if loras is None
                         else f"{num_cold} cold adapters in turn")
                print(f"| {repeat} | {label} | {len(result.ttfts)} | "
                      f"{statistics.median(result.ttfts):.3f} | {_p(result.ttfts, 0.99):.3f} | "
                      f"{within:.1%} | {result.standard_tokens_per_s:.1f} |", flush=True)
        for name, values in attained.items():
            print(f"within SLO, standard on {name}: "
                  f"{', '.join(f'{v:.1%}' for v in values)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
