"""The sampler's host work, this checkout against another, in turn (bench/sampler.py's kinds).

Each run is a fresh interpreter in one checkout, timing `Sampler.sample` on the rows of
bench.sampler.KINDS at the given batch sizes, on a 64-token vocabulary, the sampled ids read
back and appended to the runner's batch as a step would. A checkout older than 913695e has no
kept sampling columns: there the sampler reads each row's parameters from the states.
Printed: the median us per step of each run, side by side, and the after/before ratio.

    git worktree add /tmp/before 76b3c42
    python ops/bench/sampler_pairs.py --before /tmp/before [--pairs 3]
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from dataclasses import asdict
from pathlib import Path

from bench.sampler import KINDS, VOCAB_SIZE

_RUN = """
import json, statistics, sys, time
import numpy as np, torch
from engine.input_batch import InputBatch
from engine.sampler import Sampler
from engine.sampling_params import SamplingParams
from engine.scheduler_output import NewRequestData, ScheduledChunk, SchedulerOutput
kinds, batches, steps, vocab = json.loads(sys.argv[1])
torch.manual_seed(0)
out = {}
for kind, params in kinds.items():
    params = [SamplingParams(**p) for p in params]
    for n in [1] + batches:
        batch = InputBatch(16, n, 4096)
        batch.update(SchedulerOutput(0, [], 0, [NewRequestData(f"r{i}", list(range(32)), 32,
            [i], params[i % len(params)], None) for i in range(n)]))
        chunks = [ScheduledChunk(f"r{i}", 31, 1, True, False) for i in range(n)]
        rows, sampler, logits = np.arange(n), Sampler(vocab, seed=0), torch.randn(n, vocab)
        columns = getattr(batch, "sampling_columns", None)
        times = []
        for _ in range(steps + 3):
            started = time.perf_counter()
            states = batch.sample_states(chunks)
            if columns is None:
                sampled = sampler.sample(logits, states)
            else:
                sampled = sampler.sample(logits, states, columns(rows))
            ids = sampled.output().sampled_token_ids
            times.append(time.perf_counter() - started)
            pending = batch.mark_sampled(states, sampled.token_ids, rows)
            batch.append_sampled(pending, [ids[s.request_id] for s in states])
        out[f"{kind} {n}"] = statistics.median(times[3:]) * 1e6
print(json.dumps(out))
"""


def _run(checkout: Path, batches: list[int], steps: int) -> dict[str, float]:
    kinds = {kind: [{k: v for k, v in asdict(p).items() if k != "structured"} for p in params]
             for kind, params in KINDS.items()}
    arg = json.dumps([kinds, batches, steps, VOCAB_SIZE])
    done = subprocess.run([sys.executable, "-c", _RUN, arg], cwd=checkout, check=True,
                          capture_output=True, text=True)
    result: dict[str, float] = json.loads(done.stdout)
    return result


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True, help="the other checkout")
    parser.add_argument("--pairs", type=int, default=3)
    parser.add_argument("--batches", type=int, nargs="+", default=[128, 256])
    parser.add_argument("--steps", type=int, default=200)
    args = parser.parse_args()
    here = Path(__file__).resolve().parents[2]
    pairs = [(_run(args.before, args.batches, args.steps), _run(here, args.batches, args.steps))
             for _ in range(args.pairs)]
    print("| rows | before, us per step | after, us per step | after / before |")
    print("|---|---|---|---|")
    for key in pairs[0][0]:
        before = [f"{b[key]:.0f}" for b, _ in pairs]
        after = [f"{a[key]:.0f}" for _, a in pairs]
        ratio = statistics.median(a[key] / b[key] for b, a in pairs)
        print(f"| {key} | {', '.join(before)} | {', '.join(after)} | {ratio:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
