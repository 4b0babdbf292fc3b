"""Benchmark workload files (ops/bench/inputs/*.json): requests with arrival times, tenants,
tiers and lengths, and the seeded prompt token ids they stand for."""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# The benchmark inputs the repository carries (copies of the shared ones): workloads and the
# benchmark model's config. Found from this file, not the current directory, so every default
# works from any directory of a checkout (the project is installed editable).
BENCH_INPUTS = Path(__file__).resolve().parents[1] / "ops" / "bench" / "inputs"

# Token ids 0-2 are special (pad, bos, eos) and never drawn for prompts.
FIRST_ORDINARY_TOKEN_ID = 3


@dataclass(frozen=True)
class WorkloadRequest:
    request_id: str
    arrival_s: float  # seconds after the start, at the file's own rate
    tenant: str
    tier: str
    prompt_len: int
    output_len: int
    shared_prefix_len: int  # leading prompt tokens shared with the tenant's other requests


@dataclass(frozen=True)
class Workload:
    seed: int
    rate_rps: float  # the file's arrival rate (0: everything at t=0)
    requests: list[WorkloadRequest]

    @classmethod
    def load(cls, path: Path, limit: int | None = None) -> Workload:
        """The file's requests; limit: the first `limit`, cycling through the file again
        (ids suffixed "~1", "~2", ...) when it holds fewer."""
        data = json.loads(Path(path).read_text())
        rows = data["requests"]
        if limit is not None and rows:
            rows = [
                rows[i % len(rows)] if i < len(rows)
                else dict(rows[i % len(rows)], id=f"{rows[i % len(rows)]['id']}~{i // len(rows)}")
                for i in range(limit)
            ]
        requests = [
            WorkloadRequest(
                request_id=r["id"],
                arrival_s=float(r["arrival_s"]),
                tenant=r["tenant"],
                tier=r["tier"],
                prompt_len=int(r["prompt_len"]),
                output_len=int(r["output_len"]),
                shared_prefix_len=int(r.get("shared_prefix_len", 0)),
            )
            for r in rows
        ]
        return cls(seed=int(data["seed"]), rate_rps=float(data["rate_rps"]), requests=requests)

    def prompts(self, vocab_size: int, use_shared_prefix: bool = True) -> dict[str, list[int]]:
        """Seeded prompt token ids per request id; shared prefixes drawn once per tenant."""
        rng = random.Random(self.seed)
        max_prefix = max((r.shared_prefix_len for r in self.requests), default=0)
        prefixes = {
            tenant: [rng.randrange(FIRST_ORDINARY_TOKEN_ID, vocab_size) for _ in range(max_prefix)]
            for tenant in sorted({r.tenant for r in self.requests})
        }
        prompts: dict[str, list[int]] = {}
        for r in self.requests:
            num_shared = r.shared_prefix_len if use_shared_prefix else 0
            tail = [
                rng.randrange(FIRST_ORDINARY_TOKEN_ID, vocab_size)
                for _ in range(r.prompt_len - num_shared)
            ]
            prompts[r.request_id] = prefixes[r.tenant][:num_shared] + tail
        return prompts
