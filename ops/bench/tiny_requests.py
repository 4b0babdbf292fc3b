"""Tiny requests end to end: requests/s and the CPU each takes in the gateway and the engine.

    python -m ops.bench.tiny_requests [--before TREE] [--rounds 3] [--duration-s 20]

`tiergate serve --model demo` (the random-weight demo model, serve's defaults otherwise: how
its engine process's OpenMP workers wait included) serves a closed loop of `--concurrency`
connections (32), each sending /v1/completions with a 4-token prompt and max_tokens 1 as soon
as its previous answer is read, for `--duration-s` after a warm-up. Printed per round: the
requests/s, and the CPU time per request of the gateway's process and of the engine's process
(/proc, over the measured window).

With --before TREE the same runs on TREE's server (a checkout of an older commit, started
with TREE as its working directory, so that its packages are the ones imported), the two
trees alternating in each round, and the ratio after / before per round: on a noisy host only
the paired ratios compare. The client is one process of raw keep-alive HTTP/1.1 on asyncio,
cheap enough to leave the server most of a 2-core host.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from bench.serve.provision import provision_tenants, served_model_name
from bench.serve.server import VARIANTS, BenchServer, EngineLimits
from bench.serve.server_process import process_tree_cpu_s
from gateway.server.settings import GatewaySettings
from policies import TierTable

ROOT = Path(__file__).resolve().parents[2]


class TreeServer(BenchServer):
    """`tiergate serve` of a source tree, with serve's own OpenMP wait (BenchServer asks for
    passive waiting: a user who runs `tiergate serve` does not)."""

    def __init__(self, tree: Path, work_dir: Path) -> None:
        limits = EngineLimits(model_dir=None, demo_model_dir=GatewaySettings().demo_model_dir)
        super().__init__(VARIANTS["tiered"], TierTable(), limits, work_dir)
        self.tree = tree

    def cwd(self) -> Path:
        return self.tree

    def env(self) -> dict[str, str]:
        env = super().env()
        if env.get("OMP_WAIT_POLICY") == "PASSIVE":
            del env["OMP_WAIT_POLICY"]
        env["PYTHONPATH"] = str(self.tree)
        return env


@dataclass(frozen=True)
class Round:
    requests_per_s: float
    gateway_cpu_ms: float  # per request
    engine_cpu_ms: float  # per request
    errors: int


def _cpu_s(pid: int) -> tuple[float, float]:
    """CPU seconds of the gateway's process alone, and of the processes it started (the
    engine's)."""
    fields = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()
    own = (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")
    total = process_tree_cpu_s(pid)
    assert total is not None, "the server has gone"
    return own, total - own


async def _client(port: int, request: bytes, stop_at: float, counts: list[int]) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    try:
        while time.monotonic() < stop_at:
            writer.write(request)
            head = await reader.readuntil(b"\r\n\r\n")
            status = int(head.split(b" ", 2)[1])
            length = 0
            for line in head.split(b"\r\n"):
                if line.lower().startswith(b"content-length:"):
                    length = int(line.split(b":", 1)[1])
            await reader.readexactly(length)
            counts[0 if status == 200 else 1] += 1
    finally:
        writer.close()


async def _load(port: int, request: bytes, concurrency: int, duration_s: float) -> list[int]:
    counts = [0, 0]
    stop_at = time.monotonic() + duration_s
    await asyncio.gather(*(_client(port, request, stop_at, counts) for _ in range(concurrency)))
    return counts


def run_round(tree: Path, concurrency: int, duration_s: float, warmup_s: float) -> Round:
    with tempfile.TemporaryDirectory() as work:
        server = TreeServer(tree, Path(work))
        with server:
            assert server.process is not None
            key = provision_tenants(server.base_url, server.admin_token, {"tiny": "standard"})
            model = served_model_name(server.base_url, key["tiny"])
            body = json.dumps({"model": model, "prompt": [11, 12, 13, 14], "max_tokens": 1,
                               "temperature": 0}).encode()
            request = (b"POST /v1/completions HTTP/1.1\r\nhost: tiergate\r\n"
                       + f"authorization: Bearer {key['tiny']}\r\n".encode()
                       + b"content-type: application/json\r\n"
                       + f"content-length: {len(body)}\r\n\r\n".encode() + body)
            asyncio.run(_load(server.port, request, concurrency, warmup_s))
            cpu_before = _cpu_s(server.process.pid)
            started = time.monotonic()
            ok, errors = asyncio.run(_load(server.port, request, concurrency, duration_s))
            elapsed = time.monotonic() - started
            cpu_after = _cpu_s(server.process.pid)
    done = max(ok, 1)
    return Round(ok / elapsed, (cpu_after[0] - cpu_before[0]) / done * 1e3,
                 (cpu_after[1] - cpu_before[1]) / done * 1e3, errors)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--before", type=Path, help="a source tree to compare against")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--duration-s", type=float, default=20.0)
    parser.add_argument("--warmup-s", type=float, default=3.0)
    parser.add_argument("--concurrency", type=int, default=32)
    args = parser.parse_args()
    trees = {"after": ROOT}
    if args.before is not None:
        trees = {"before": args.before.resolve(), "after": ROOT}
    print(f"tiny requests: 4-token prompt, 1 output token, {args.concurrency} concurrent, "
          f"demo model, {args.duration_s:.0f} s per run")
    print("| round | tree | requests/s | gateway CPU ms/request | engine CPU ms/request "
          "| errors |")
    print("|---|---|---|---|---|---|")
    results: dict[str, list[Round]] = {name: [] for name in trees}
    for index in range(args.rounds):
        names = list(trees) if index % 2 == 0 else list(reversed(trees))
        for name in names:
            result = run_round(trees[name], args.concurrency, args.duration_s, args.warmup_s)
            results[name].append(result)
            print(f"| {index} | {name} | {result.requests_per_s:.1f} | "
                  f"{result.gateway_cpu_ms:.2f} | {result.engine_cpu_ms:.2f} | "
                  f"{result.errors} |", flush=True)
    for name, rounds in results.items():
        print(f"{name}: median {statistics.median(r.requests_per_s for r in rounds):.1f} "
              f"requests/s, gateway "
              f"{statistics.median(r.gateway_cpu_ms for r in rounds):.2f}, engine "
              f"{statistics.median(r.engine_cpu_ms for r in rounds):.2f} ms CPU/request")
    if "before" in results:
        ratios = [a.requests_per_s / b.requests_per_s
                  for a, b in zip(results["after"], results["before"], strict=True)]
        print("after / before per round: " + ", ".join(f"{r:.2f}" for r in ratios)
              + f" (median {statistics.median(ratios):.2f})")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
