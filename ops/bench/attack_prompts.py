"""Large-prompt attack on `tiergate serve` (issue 36's first row), measured from outside.

A tenant limited to 1 request a minute sends ~4 MB chat prompts back to back from several
connections while another tenant sends short streamed chats one after the other; the same
victim requests are timed first alone. Printed: the victim's TTFT (p50/p99/max), the slowest
`/health/live` answer, the server's event-loop lag p99 (from its
`tiergate_event_loop_lag_seconds` histogram: the upper bound of the bucket), and what the
attacker got. Self-contained (stdlib + httpx), so it runs against any checkout: run it from
the checkout to measure (it starts `python -m gateway.cli serve --model demo` there).

    python ops/bench/attack_prompts.py [--victim-requests 20] [--attackers 3] [--seed 0]
"""

from __future__ import annotations

import argparse
import collections
import json
import multiprocessing
import os
import random
import secrets
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

import httpx

_WORDS = [
    "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be",
    "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--victim-requests", type=int, default=20)
    parser.add_argument("--attackers", type=int, default=3)
    parser.add_argument("--prompt-chars", type=int, default=4_000_000)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    words: list[str] = []
    size = 0
    while size < args.prompt_chars:
        words.append(rng.choice(_WORDS))
        size += len(words[-1]) + 1
    attack_body = json.dumps({
        "model": "tiergate-demo", "max_tokens": 1,
        "messages": [{"role": "user", "content": " ".join(words)[: args.prompt_chars]}],
    }).encode()
    with tempfile.TemporaryDirectory() as work, _Server(Path(work)) as server:
        attacker_key = server.tenant("attacker", {"requests_per_minute": 1})
        victim_key = server.tenant("victim", {})
        rows = []
        for phase, num_attackers in (("alone", 0), ("under attack", args.attackers)):
            rows.append(
                _phase(server, phase, victim_key, attacker_key, attack_body, num_attackers,
                       args.victim_requests)
            )
    print(f"attack: {args.attackers} connections x {len(attack_body):,}-byte chat bodies, "
          f"1-RPM key; victim: {args.victim_requests} streamed chats one after another, "
          f"max_tokens 8 (demo model, seed {args.seed})")
    header = ("phase", "victim TTFT p50 ms", "p99 ms", "max ms", "/health/live max ms",
              "loop lag p99 ms", "attacker answers")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def _phase(
    server: _Server, name: str, victim_key: str, attacker_key: str, attack_body: bytes,
    num_attackers: int, num_requests: int,
) -> tuple[str, ...]:
    stop = threading.Event()
    live_s: list[float] = []

    def probe_live() -> None:
        with httpx.Client(base_url=server.base_url, timeout=120) as client:
            while not stop.is_set():
                start = time.perf_counter()
                client.get("/health/live")
                live_s.append(time.perf_counter() - start)
                time.sleep(0.1)

    lag_before = server.loop_lag_buckets()
    # Attackers in processes of their own: in this one they would take the GIL from the
    # victim's client and inflate its TTFT.
    context = multiprocessing.get_context("spawn")
    stop_attack = context.Event()
    answers_queue: multiprocessing.Queue[dict[str, int]] = context.Queue()
    attackers = [
        context.Process(
            target=_attack,
            args=(server.base_url, attacker_key, attack_body, stop_attack, answers_queue),
        )
        for _ in range(num_attackers)
    ]
    for attacker in attackers:
        attacker.start()
    prober = threading.Thread(target=probe_live)
    prober.start()
    time.sleep(2.0 if num_attackers else 0.0)  # the attack under way
    ttfts = []
    with httpx.Client(base_url=server.base_url, timeout=120) as client:
        for index in range(num_requests):
            body = {"model": "tiergate-demo", "max_tokens": 8, "stream": True,
                    "messages": [{"role": "user", "content": f"question {index}: hello"}]}
            start = time.perf_counter()
            with client.stream("POST", "/v1/chat/completions", json=body,
                               headers={"authorization": f"Bearer {victim_key}"}) as response:
                response.raise_for_status()
                lines = response.iter_lines()
                for line in lines:
                    if line.startswith("data: ") and '"content"' in line:
                        ttfts.append(time.perf_counter() - start)
                        break
                for _ in lines:
                    pass
    stop.set()
    stop_attack.set()
    answers: collections.Counter[str] = collections.Counter()
    for _ in attackers:
        answers.update(answers_queue.get(timeout=300))
    for attacker in attackers:
        attacker.join()
    prober.join()
    lag_after = server.loop_lag_buckets()
    lag = [after - before for before, after in zip(lag_before, lag_after, strict=True)]
    ttfts.sort()
    return (
        name,
        f"{_ms(ttfts[len(ttfts) // 2])}",
        f"{_ms(ttfts[min(len(ttfts) - 1, round(0.99 * len(ttfts)))])}",
        f"{_ms(ttfts[-1])}",
        f"{_ms(max(live_s))}",
        _bucket_p99(server.loop_lag_bounds(), lag),
        ", ".join(f"{count} x {code}" for code, count in sorted(answers.items())) or "-",
    )


def _attack(
    base_url: str, key: str, body: bytes, stop: Any, answers_queue: Any
) -> None:
    """One attacker connection sending the body back to back until stop is set."""
    answers: collections.Counter[str] = collections.Counter()
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    with httpx.Client(base_url=base_url, timeout=120) as client:
        while not stop.is_set():
            try:
                response = client.post("/v1/chat/completions", content=body, headers=headers)
                answers[str(response.status_code)] += 1
            except httpx.HTTPError as exc:
                answers[type(exc).__name__] += 1
    answers_queue.put(dict(answers))


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f}"


def _bucket_p99(bounds: list[float], counts: list[float]) -> str:
    """counts: cumulative bucket counts of a Prometheus histogram."""
    total = counts[-1]
    if not total:
        return "-"
    for bound, count in zip(bounds, counts, strict=True):
        if count >= 0.99 * total:
            return "> " + _ms(bounds[-2]) if bound == float("inf") else f"<= {_ms(bound)}"
    return "-"


class _Server:
    def __init__(self, work: Path) -> None:
        self.work = work
        self.admin_token = secrets.token_hex(16)
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> _Server:
        env = {**os.environ, "TIERGATE_ADMIN_TOKEN": self.admin_token, "OMP_WAIT_POLICY": "PASSIVE"}
        env.pop("TIERGATE_REDIS_URL", None)
        log = (self.work / "serve.log").open("wb")
        self.process = subprocess.Popen(
            [sys.executable, "-m", "gateway.cli", "serve", "--model", "demo",
             "--port", str(self.port), "--database-url", f"sqlite:///{self.work}/t.db",
             "--data-dir", str(self.work / "data"), "--log-level", "warning"],
            env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
        )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            try:
                if httpx.get(f"{self.base_url}/health/ready", timeout=2).status_code == 200:
                    return self
            except httpx.HTTPError:
                pass
            time.sleep(0.5)
        raise RuntimeError(f"the server did not start: {(self.work / 'serve.log').read_text()}")

    def __exit__(self, *exc: object) -> None:
        if self.process is not None:
            self.process.send_signal(signal.SIGTERM)
            try:
                self.process.wait(60)
            except subprocess.TimeoutExpired:
                self.process.kill()

    def tenant(self, name: str, quota: dict[str, int]) -> str:
        headers = {"x-admin-token": self.admin_token}
        with httpx.Client(base_url=self.base_url, headers=headers, timeout=30) as admin:
            created = admin.post("/admin/v1/tenants",
                                 json={"name": name, "tier": "standard", "quota": quota})
            created.raise_for_status()
            key = admin.post(f"/admin/v1/tenants/{created.json()['id']}/keys",
                             json={"name": "attack"})
            key.raise_for_status()
            return str(key.json()["key"])

    def _lag_lines(self) -> list[tuple[float, float]]:
        text = httpx.get(f"{self.base_url}/metrics", timeout=30).text
        buckets = []
        for line in text.splitlines():
            if line.startswith("tiergate_event_loop_lag_seconds_bucket"):
                bound = line.split('le="')[1].split('"')[0]
                buckets.append((float(bound), float(line.rsplit(" ", 1)[1])))
        return buckets

    def loop_lag_bounds(self) -> list[float]:
        return [bound for bound, _ in self._lag_lines()]

    def loop_lag_buckets(self) -> list[float]:
        return [count for _, count in self._lag_lines()]


if __name__ == "__main__":
    main()
