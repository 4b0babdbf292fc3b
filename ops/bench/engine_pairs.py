"""The engine's host work per step in two source trees, measured in pairs.

    python ops/bench/engine_pairs.py --before TREE --after TREE [--pairs 6] [--policy tiered]

Each pair runs one process on each tree, the order alternating between pairs; a process
imports the engine of its tree (its working directory and PYTHONPATH), takes the minimum of
--runs runs of `bench.engine.measure_decode` (the function behind `tiergate bench engine`'s
decode table) at 128 and 256 running decodes of 1,024-token contexts and of
`bench.engine.measure_short` at 32 requests, and prints them. A tree is a checkout (a git
worktree of an older commit, say). On a
noisy 2-core host two processes run minutes apart differ by up to 2x: only the per-pair ratios
compare.

--policy tiered runs them under the tiered policy (four tenants in three tiers) instead of the
engine's FCFS policy, as `tiergate bench engine --policy tiered` does.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from bench.engine import POLICIES

# Runs in each tree: trees older than --policy measure FCFS only.
_MEASURE = r"""
import json, sys
from bench.engine import measure_decode, measure_short
import inspect
runs, policy = int(sys.argv[1]), sys.argv[2]
kwargs = {} if policy == "fcfs" else {"policy": policy}
if kwargs and "policy" not in inspect.signature(measure_decode).parameters:
    sys.exit("this tree's bench.engine measures the FCFS policy only")
row = {}
for n in (128, 256):
    row[str(n)] = min(measure_decode(n, 1024, 50, s, **kwargs) for s in range(runs)) / n * 1e6
row["short"] = min(measure_short(32, s, **kwargs) for s in range(runs)) * 1e6
print(json.dumps(row))
"""


def measure(tree: Path, runs: int, policy: str) -> dict[str, Any]:
    tree = tree.resolve()
    done = subprocess.run(
        [sys.executable, "-c", _MEASURE, str(runs), policy],
        cwd=tree, capture_output=True, text=True, check=False,
        env={**os.environ, "PYTHONPATH": str(tree)},
    )
    if done.returncode != 0:
        raise SystemExit(f"{tree}: {done.stderr[-2000:]}")
    row: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return row


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--before", type=Path, required=True)
    parser.add_argument("--after", type=Path, required=True)
    parser.add_argument("--pairs", type=int, default=6, choices=range(1, 101),
                        metavar="1..100")
    parser.add_argument("--runs", type=int, default=7, help="runs per process (their minimum)")
    parser.add_argument("--policy", choices=POLICIES, default="fcfs")
    args = parser.parse_args()
    keys = ["128", "256", "short"]
    print("us per running request (short: per request); after / before per pair")
    print("| pair | first | " + " | ".join(f"{k} before / after" for k in keys) + " |")
    print("|---" * (len(keys) + 2) + "|")
    ratios: dict[str, list[float]] = {k: [] for k in keys}
    for pair in range(args.pairs):
        first, second = ("before", "after") if pair % 2 == 0 else ("after", "before")
        rows = {name: measure(getattr(args, name), args.runs, args.policy)
                for name in (first, second)}
        cells = []
        for key in keys:
            before, after = rows["before"][key], rows["after"][key]
            ratios[key].append(after / before)
            cells.append(f"{before:.2f} / {after:.2f} ({after / before:.3f})")
        print(f"| {pair} | {first} | " + " | ".join(cells) + " |", flush=True)
    print("median after / before: " + ", ".join(
        f"{k} {statistics.median(v):.3f}" for k, v in ratios.items()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
