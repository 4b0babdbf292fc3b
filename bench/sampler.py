"""The sampler's host work per step: `Sampler.sample` on a small vocabulary.

NoWorkRunner (bench.engine) leaves the sampler out. A real step runs it, and on a GPU what it
costs the host (deciding per row, building the small tables, launching the kernels) is spent
while the device waits, unless async scheduling hides it. Here the real Sampler samples from
a runner's InputBatch (engine.input_batch, the parameters it keeps per row) on a 64-token
vocabulary, where the tensor work is small and most of the time is the host's. Four kinds
of rows: greedy; top-p; seeded; and a mixed set (greedy, top-k, a presence penalty with a
seed, top-p with logprobs and min_tokens, in turn).
"""

from __future__ import annotations

import random
import statistics
import time
from dataclasses import dataclass

import numpy as np
import torch

from engine.sample.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler_output import NewRequestData, ScheduledChunk, SchedulerOutput
from engine.worker.input_batch import InputBatch

__all__ = ["KINDS", "SamplerRow", "format_table", "measure"]

VOCAB_SIZE = 64
_MIXED = [
    SamplingParams(temperature=0.0, max_tokens=1 << 20),
    SamplingParams(temperature=0.7, top_k=20, max_tokens=1 << 20),
    SamplingParams(temperature=1.0, presence_penalty=0.5, seed=3, max_tokens=1 << 20),
    SamplingParams(temperature=0.8, top_p=0.9, logprobs=2, min_tokens=4, max_tokens=1 << 20),
]
KINDS = {
    "greedy": [SamplingParams(temperature=0.0, max_tokens=1 << 20)],
    "top_p": [SamplingParams(temperature=0.8, top_p=0.9, max_tokens=1 << 20)],
    "seeded": [SamplingParams(temperature=0.8, seed=7, max_tokens=1 << 20)],
    "mixed": _MIXED,
}


@dataclass
class SamplerRow:
    kind: str  # a key of KINDS
    num_rows: int
    step_us: float  # median over the repeats
    step_us_min: float
    step_us_max: float


def measure(kind: str, num_rows: int, num_steps: int, seed: int) -> float:
    """Seconds per sampling step of num_rows rows of KINDS[kind] (their ids read back)."""
    torch.manual_seed(seed)
    rng = random.Random(seed)
    params = KINDS[kind]
    batch = InputBatch(16, num_rows, 4096)
    prompt_len = 32
    news = [
        NewRequestData(f"r{i}", [rng.randrange(VOCAB_SIZE) for _ in range(prompt_len)],
                       prompt_len, [i], params[i % len(params)], None)
        for i in range(num_rows)
    ]
    batch.update(SchedulerOutput(0, [], 0, new_requests=news))
    chunks = [ScheduledChunk(f"r{i}", prompt_len - 1, 1, True, False) for i in range(num_rows)]
    rows = np.arange(num_rows)
    sampler = Sampler(VOCAB_SIZE, seed=seed)
    logits = torch.randn(num_rows, VOCAB_SIZE)
    warm_up, times = 3, []
    for _ in range(num_steps + warm_up):
        started = time.perf_counter()
        states = batch.sample_states(chunks)
        sampled = sampler.sample(logits, states, batch.sampling_columns(rows))
        token_ids = sampled.output().sampled_token_ids
        times.append(time.perf_counter() - started)
        pending = batch.mark_sampled(states, sampled.token_ids, rows)
        batch.append_sampled(pending, [token_ids[s.request_id] for s in states])
    return statistics.median(times[warm_up:])


def run(batches: list[int], num_steps: int, repeats: int, seed: int) -> list[SamplerRow]:
    measure("greedy", 1, num_steps, seed)  # warm-up: the first calls of each torch op
    rows = []
    for kind in KINDS:
        for num_rows in batches:
            times = [measure(kind, num_rows, num_steps, seed + r) * 1e6 for r in range(repeats)]
            rows.append(SamplerRow(kind, num_rows, statistics.median(times), min(times),
                                   max(times)))
    return rows


def format_table(rows: list[SamplerRow], repeats: int) -> str:
    lines = [
        f"Sampler host work per step ({VOCAB_SIZE}-token vocabulary), median of {repeats} "
        "(min-max)",
        "",
        "| rows | kind | us per step | us per row |",
        "|---|---|---|---|",
    ]
    for row in rows:
        lines.append(
            f"| {row.num_rows} | {row.kind} | {row.step_us:.0f} ({row.step_us_min:.0f}-"
            f"{row.step_us_max:.0f}) | {row.step_us / row.num_rows:.2f} |"
        )
    return "\n".join(lines)
