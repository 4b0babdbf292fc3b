"""Structured outputs on the CPU: what a JSON-schema constraint costs the engine.

Three measurements on the default model (SmolLM2-135M-Instruct, float32), one process, a
fixed seed, printed as tables:

1. throughput: 32 requests at once (the ten benchmark schemas in turn, temperature 1.0,
   seeded) constrained by their schema, and the same 32 unconstrained with each request's
   output length fixed to what it produced constrained (ignore_eos), so both runs generate
   as many tokens in the same batches and differ by the constraint alone; a first
   constrained run compiles the schemas, then pairs of runs in alternating order;
2. compile time of the ten schemas, cold (an empty cache; the tokenizer's index, built once
   per engine, reported apart) and cached (a hit: a copy of the compiled matcher), 20 rounds;
3. step cost: two engines side by side, each with 32 running decodes, one of them with one
   constrained request among 31 unconstrained ones; their steps alternate and are compared
   pair by pair.

    .venv/bin/python ops/bench/structured_outputs.py [--rounds 20] [--runs 5] [--pairs 60]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from engine import EngineConfig, LLMEngine, RunnerConfig, SamplingParams, SchedulerConfig
from engine.models.config import ModelConfig
from engine.output_spec import StructuredOutput
from engine.structured_output.grammar_compiler import GrammarCompiler
from engine.text.tokenizer import Tokenizer
from engine.worker.model_runner import TorchModelRunner
from gateway.openai.chat_template import ChatTokenizer
from gateway.server.model_source import default_model_file, gguf_model_dir

SCHEMAS: dict[str, dict[str, object]] = json.loads(
    (Path(__file__).parent / "inputs" / "structured-schemas.json").read_text()
)
NUM_REQUESTS = 32
MAX_TOKENS = 400


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def _engine(model_dir: Path, tokenizer: Tokenizer, config: ModelConfig) -> LLMEngine:
    assert tokenizer.eos_token_id is not None
    engine_config = EngineConfig(
        scheduler=SchedulerConfig(max_num_batched_tokens=2048, max_num_seqs=NUM_REQUESTS,
                                  max_model_len=2048),
        eos_token_id=tokenizer.eos_token_id,
        runner=RunnerConfig(kv_cache_bytes=512 << 20, sampler_seed=0),
    )
    return LLMEngine(
        engine_config, TorchModelRunner.from_model_dir(model_dir, engine_config),
        tokenizer=tokenizer,
        grammars=GrammarCompiler(tokenizer, config.vocab_size,
                                 [tokenizer.eos_token_id]),
    )


def _prompt(tokenizer: ChatTokenizer, name: str) -> list[int]:
    text = tokenizer.apply_chat_template([
        {"role": "system", "content": "You answer with JSON only."},
        {"role": "user", "content": f"Give an example {name} record as JSON."},
    ])
    return tokenizer.encode(text, add_special_tokens=False)


def _run(engine: LLMEngine) -> tuple[float, dict[str, int], float]:
    """(wall seconds, output tokens per request, seconds spent waiting for grammars)."""
    started = time.perf_counter()
    lengths: dict[str, int] = {}
    compile_s = 0.0
    while engine.has_unfinished_requests():
        for out in engine.step():
            if out.finished:
                lengths[out.request_id] = out.num_output_tokens
                if out.metrics is not None:
                    compile_s += out.metrics.grammar_compile_s
    return time.perf_counter() - started, lengths, compile_s


def throughput(
    model_dir: Path, tokenizer: ChatTokenizer, config: ModelConfig, pairs: int
) -> None:
    names = [list(SCHEMAS)[i % len(SCHEMAS)] for i in range(NUM_REQUESTS)]
    engine = _engine(model_dir, tokenizer, config)
    # Warm up (first steps, the grammar tokenizer's index) outside the timed runs.
    engine.add_request("warm", _prompt(tokenizer, "person"), SamplingParams(
        max_tokens=8, structured=StructuredOutput.json_schema(SCHEMAS["person"], "x")))
    _run(engine)

    def constrained_run(round_: int) -> tuple[float, dict[str, int], float]:
        for i, name in enumerate(names):
            engine.add_request(f"c{round_}-{i}", _prompt(tokenizer, name), SamplingParams(
                temperature=1.0, seed=i, max_tokens=MAX_TOKENS,
                structured=StructuredOutput.json_schema(SCHEMAS[name], "response_format")))
        return _run(engine)

    def free_run(round_: int, lengths: dict[str, int]) -> float:
        for i, name in enumerate(names):
            engine.add_request(f"u{round_}-{i}", _prompt(tokenizer, name), SamplingParams(
                temperature=1.0, seed=i, max_tokens=lengths[f"c0-{i}"], ignore_eos=True))
        seconds, free_lengths, _ = _run(engine)
        assert sum(free_lengths.values()) == sum(lengths.values())
        return seconds

    # Round 0 compiles the ten schemas (cold); later rounds find them cached.
    first_s, lengths, cold_compile_s = constrained_run(0)
    total = sum(lengths.values())
    ratios, constrained_times, free_times = [], [], []
    for round_ in range(1, pairs + 1):
        # Alternate which goes first: the machine drifts within a pair too.
        if round_ % 2:
            free_s = free_run(round_, lengths)
            constrained_s, again, _ = constrained_run(round_)
        else:
            constrained_s, again, _ = constrained_run(round_)
            free_s = free_run(round_, lengths)
        assert again == {k.replace("c0-", f"c{round_}-"): v for k, v in lengths.items()}
        constrained_times.append(constrained_s)
        free_times.append(free_s)
        ratios.append(free_s / constrained_s)  # constrained tok/s over unconstrained tok/s
    print(f"\n## 1. {NUM_REQUESTS} requests at once, {total} output tokens a run, "
          f"{pairs} alternating pairs")
    print("| run | median wall s | median output tok/s |")
    print("|---|---|---|")
    free_median = statistics.median(free_times)
    constrained_median = statistics.median(constrained_times)
    print(f"| unconstrained (same lengths) | {free_median:.2f} | {total / free_median:.1f} |")
    print(f"| json_schema (10 schemas, cached) | {constrained_median:.2f} | "
          f"{total / constrained_median:.1f} |")
    print(f"| json_schema, first run (compiling) | {first_s:.2f} | {total / first_s:.1f} |")
    print("tok/s ratio constrained/unconstrained by pair: "
          + ", ".join(f"{r:.3f}" for r in ratios)
          + f"; median {statistics.median(ratios):.3f}; compile waited for in the first run: "
          f"{1e3 * cold_compile_s:.1f} ms")


def compile_times(tokenizer: Tokenizer, config: ModelConfig, rounds: int) -> None:
    assert tokenizer.eos_token_id is not None
    started = time.perf_counter()
    compiler = GrammarCompiler(tokenizer, config.vocab_size, [tokenizer.eos_token_id])
    compiler.warm_up()
    compiler.compile(StructuredOutput("regex", "x")).result()  # waits for the index
    index_s = time.perf_counter() - started
    constraints = [StructuredOutput.json_schema(s, "x") for s in SCHEMAS.values()]
    cold: list[float] = []
    cached: list[float] = []
    for round_index in range(rounds):
        salt = f"round-{round_index}"  # cold: a tenant of its own, the index kept
        for constraint in constraints:
            t0 = time.perf_counter()
            compiler.compile_now(constraint, salt)
            cold.append(time.perf_counter() - t0)
        for constraint in constraints:
            t0 = time.perf_counter()
            result = compiler.compile(constraint, salt).result()
            result.grammar.matcher()
            cached.append(time.perf_counter() - t0)
    print(f"\n## 2. compile time, 10 schemas x {rounds} rounds "
          f"(tokenizer index, once per engine: {1e3 * index_s:.0f} ms)")
    print("| | p50 ms | p99 ms | max ms |")
    print("|---|---|---|---|")
    for label, values in (("cold", cold), ("cached (hit + new matcher)", cached)):
        print(f"| {label} | {1e3 * statistics.median(values):.3f} | "
              f"{1e3 * _percentile(values, 0.99):.3f} | {1e3 * max(values):.3f} |")


def step_cost(
    model_dir: Path, tokenizer: ChatTokenizer, config: ModelConfig, pairs: int
) -> None:
    plain = _engine(model_dir, tokenizer, config)
    mixed = _engine(model_dir, tokenizer, config)
    # A schema that keeps the constrained request open: a list of orders.
    open_ended = StructuredOutput.json_schema(
        {"type": "array", "items": SCHEMAS["order"]}, "response_format")
    for engine, constrained in ((plain, False), (mixed, True)):
        for i in range(NUM_REQUESTS):
            name = list(SCHEMAS)[i % len(SCHEMAS)]
            structured = open_ended if constrained and i == 0 else None
            engine.add_request(f"s{i}", _prompt(tokenizer, name), SamplingParams(
                temperature=1.0, seed=i, max_tokens=1500, ignore_eos=structured is None,
                structured=structured))
    # Prefill and a few decodes outside the timed pairs.
    for _ in range(8):
        plain.step()
        mixed.step()
    plain_s: list[float] = []
    mixed_s: list[float] = []
    for _ in range(pairs):
        for engine, times in ((plain, plain_s), (mixed, mixed_s)):
            t0 = time.perf_counter()
            outputs = engine.step()
            times.append(time.perf_counter() - t0)
            assert len(outputs) == NUM_REQUESTS, "every request decodes in every timed step"
    ratios = [m / p for m, p in zip(mixed_s, plain_s, strict=True)]
    print(f"\n## 3. one step of {NUM_REQUESTS} decodes, {pairs} alternating pairs")
    print("| engine | mean step ms | median step ms |")
    print("|---|---|---|")
    print(f"| 32 unconstrained | {1e3 * statistics.mean(plain_s):.1f} | "
          f"{1e3 * statistics.median(plain_s):.1f} |")
    print(f"| 1 json_schema + 31 unconstrained | {1e3 * statistics.mean(mixed_s):.1f} | "
          f"{1e3 * statistics.median(mixed_s):.1f} |")
    print(f"step ratio mixed/plain: median {statistics.median(ratios):.3f}, "
          f"mean {statistics.mean(ratios):.3f}, p10 {_percentile(ratios, 0.1):.3f}, "
          f"p90 {_percentile(ratios, 0.9):.3f}")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="compile-time rounds")
    parser.add_argument("--runs", type=int, default=5, help="throughput pairs")
    parser.add_argument("--pairs", type=int, default=60, help="step pairs")
    args = parser.parse_args()
    torch.manual_seed(0)
    model_dir = gguf_model_dir(default_model_file(Path.home() / ".cache/tiergate/models"),
                               Path.home() / ".cache/tiergate/models", torch.float32)
    tokenizer = ChatTokenizer.from_dir(model_dir)
    config = ModelConfig.from_file(model_dir)
    print(f"structured outputs, SmolLM2-135M-Instruct float32, torch threads "
          f"{torch.get_num_threads()}")
    throughput(model_dir, tokenizer, config, args.runs)
    compile_times(tokenizer, config, args.rounds)
    step_cost(model_dir, tokenizer, config, args.pairs)


if __name__ == "__main__":
    main()
