"""Does a batch hurt the premium tier? Premium TTFT SLO attainment under the same interactive
load with and without a 1,000-line batch running, on the default model.

    python -m ops.bench.batch_interference [--rounds 3] [--duration-s 60] [--rate 1.0]
        [--lines 1000] [--seed 0]

One `tiergate serve` of the default model (SmolLM2-135M-Instruct, float32, tiered scheduling,
shedding on). A premium tenant streams chat requests (Poisson arrivals at --rate per second,
seeded, max_tokens 32) for --duration-s; its TTFT is read at the first content chunk and
compared with the premium tier's TTFT SLO. In each round the load runs twice, once alone and
once with a batch of --lines lines (a standard tenant's, through the official openai SDK:
files.create, batches.create) started with it, in alternating order; the batch's lines share
eight system prompts (the prefix cache's case). After a run with the batch, the batch is
waited for and its completion time and line counts printed. The table gives each run's
attainment and p50/p99 TTFT, and per round the difference with the batch minus without.
"""

from __future__ import annotations

import argparse
import asyncio
import io
import json
import random
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import openai
import torch

from bench.serve.provision import provision_tenants
from bench.serve.server import VARIANTS, BenchServer, EngineLimits
from gateway.server.model_source import default_model_file, gguf_model_dir
from gateway.server.settings import GatewaySettings
from policies import TierTable

MAX_TOKENS = 32
SYSTEM_PROMPTS = [f"You are assistant number {i}. Answer in one short sentence, politely, "
                  f"and mention the topic {topic}." for i, topic in enumerate(
                      ["weather", "music", "history", "cooking", "travel", "science", "sport",
                       "art"])]
QUESTIONS = ["What should I do today?", "Tell me something interesting.", "Why is the sky blue?",
             "Give me a tip.", "What is a good book?", "How do I relax?"]


@dataclass(frozen=True)
class LoadRun:
    with_batch: bool
    ttfts_s: list[float]
    errors: int
    slo_s: float
    sent_at_s: list[float]  # each TTFT's request, seconds into the run

    @property
    def misses_at_s(self) -> list[float]:
        """When the requests that missed the SLO were sent, seconds into the run."""
        return [at for at, t in zip(self.sent_at_s, self.ttfts_s, strict=True) if t > self.slo_s]

    @property
    def attainment(self) -> float:
        return sum(t <= self.slo_s for t in self.ttfts_s) / max(1, len(self.ttfts_s) + self.errors)


def _percentile(values: list[float], q: float) -> float:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))] if ordered else float("nan")


async def _one(client: httpx.AsyncClient, key: str, model: str, rng: random.Random
               ) -> float | None:
    body = {"model": model, "max_tokens": MAX_TOKENS, "stream": True, "temperature": 0.7,
            "messages": [{"role": "user", "content": rng.choice(QUESTIONS)}]}
    started = time.perf_counter()
    async with client.stream("POST", "/v1/chat/completions", json=body,
                             headers={"authorization": f"Bearer {key}"}) as response:
        if response.status_code != 200:
            await response.aread()
            return None
        first: float | None = None
        async for line in response.aiter_lines():
            if first is None and line.startswith("data: {") and '"content":"' in line:
                first = time.perf_counter() - started
        return first


async def _load(base_url: str, key: str, model: str, rate: float, duration_s: float,
                seed: int) -> tuple[list[float], list[float], int]:
    """(TTFTs, when each one's request was sent, errors)."""
    rng = random.Random(seed)
    ttfts: list[float] = []
    sent_at: list[float] = []
    errors = 0
    started = time.perf_counter()

    async def send(client: httpx.AsyncClient, request_rng: random.Random) -> None:
        nonlocal errors
        at_s = time.perf_counter() - started
        try:
            ttft = await _one(client, key, model, request_rng)
        except httpx.HTTPError:
            ttft = None
        if ttft is None:
            errors += 1
        else:
            ttfts.append(ttft)
            sent_at.append(at_s)

    async with httpx.AsyncClient(base_url=base_url, timeout=120.0, trust_env=False) as client:
        tasks = []
        deadline = time.perf_counter() + duration_s
        while time.perf_counter() < deadline:
            tasks.append(asyncio.create_task(send(client, random.Random(rng.random()))))
            await asyncio.sleep(rng.expovariate(rate))
        await asyncio.gather(*tasks)
    return ttfts, sent_at, errors


def _batch_file(lines: int, model: str, seed: int) -> io.BytesIO:
    rng = random.Random(seed)
    rows = []
    for i in range(lines):
        rows.append({"custom_id": f"line-{i}", "method": "POST", "url": "/v1/chat/completions",
                     "body": {"model": model, "max_tokens": 16, "temperature": 0,
                              "messages": [
                                  {"role": "system", "content": rng.choice(SYSTEM_PROMPTS)},
                                  {"role": "user", "content": rng.choice(QUESTIONS)}]}})
    return io.BytesIO(b"".join(json.dumps(r).encode() + b"\n" for r in rows))


def _start_batch(client: openai.OpenAI, lines: int, model: str, seed: int) -> str:
    file = client.files.create(file=("batch.jsonl", _batch_file(lines, model, seed)),
                               purpose="batch")
    return client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                 completion_window="24h").id


def _wait_batch(client: openai.OpenAI, batch_id: str, started: float) -> str:
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in ("completed", "failed", "expired", "cancelled"):
            counts = batch.request_counts
            assert counts is not None
            return (f"batch {batch.status} in {time.perf_counter() - started:.0f} s: "
                    f"{counts.completed} completed, {counts.failed} failed of {counts.total}")
        time.sleep(1.0)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=60.0)
    parser.add_argument("--rate", type=float, default=1.0, help="premium requests per second")
    parser.add_argument("--lines", type=int, default=1000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()

    tiers = TierTable()
    slo_s = tiers["premium"].ttft_slo_s
    assert slo_s is not None
    with tempfile.TemporaryDirectory(prefix="batch-interference-") as work:
        model_dir = gguf_model_dir(default_model_file(Path("/nonexistent")), Path(work) / "model",
                                   torch.float32)
        limits = EngineLimits(model_dir=model_dir,
                              demo_model_dir=GatewaySettings().demo_model_dir)
        with BenchServer(VARIANTS["tiered"], tiers, limits, Path(work) / "server") as server:
            keys = provision_tenants(server.base_url, server.admin_token,
                                     {"interactive": "premium", "nightly": "standard"})
            model = httpx.get(f"{server.base_url}/v1/models", trust_env=False, headers={
                "authorization": f"Bearer {keys['interactive']}"}).json()["data"][0]["id"]
            sdk = openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=keys["nightly"],
                                max_retries=3, timeout=120.0)
            runs: list[LoadRun] = []
            notes = []
            for round_index in range(args.rounds):
                order = [False, True] if round_index % 2 == 0 else [True, False]
                for with_batch in order:
                    seed = args.seed * 1000 + round_index
                    batch_id = None
                    started = time.perf_counter()
                    if with_batch:
                        batch_id = _start_batch(sdk, args.lines, model, seed)
                    ttfts, sent_at, errors = asyncio.run(_load(
                        server.base_url, keys["interactive"], model, args.rate, args.duration_s,
                        seed))
                    runs.append(LoadRun(with_batch, ttfts, errors, slo_s, sent_at))
                    if batch_id is not None:
                        notes.append(f"round {round_index + 1}: "
                                     + _wait_batch(sdk, batch_id, started))
    _report(runs, args, slo_s, notes)


def _report(runs: list[LoadRun], args: argparse.Namespace, slo_s: float,
            notes: list[str]) -> None:
    print(f"\npremium load {args.rate}/s for {args.duration_s:.0f} s, TTFT SLO {slo_s} s; "
          f"batch of {args.lines} lines (seed {args.seed})\n")
    print("| round | batch | requests | errors | attainment | TTFT p50 (s) | TTFT p99 (s) |")
    print("|---|---|---|---|---|---|---|")
    for index, run in enumerate(runs):
        print(f"| {index // 2 + 1} | {'with' if run.with_batch else 'without'} | "
              f"{len(run.ttfts_s)} | {run.errors} | {run.attainment:.3f} | "
              f"{_percentile(run.ttfts_s, 0.5):.3f} | {_percentile(run.ttfts_s, 0.99):.3f} |")
    pairs = [(a, b) for a, b in zip(runs[::2], runs[1::2], strict=True)]
    diffs = [(b if b.with_batch else a).attainment - (a if b.with_batch else b).attainment
             for a, b in pairs]
    alone = [r.attainment for r in runs if not r.with_batch]
    print(f"\nattainment with the batch minus without, per round: "
          f"{', '.join(f'{d:+.3f}' for d in diffs)} (median {statistics.median(diffs):+.3f}); "
          f"without the batch it ranged {min(alone):.3f}-{max(alone):.3f}")
    for index, run in enumerate(runs):
        if run.misses_at_s:
            print(f"round {index // 2 + 1} {'with' if run.with_batch else 'without'}: misses "
                  f"sent at {', '.join(f'{at:.1f}' for at in run.misses_at_s)} s")
    for note in notes:
        print(note)


if __name__ == "__main__":
    main()
