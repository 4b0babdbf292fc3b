"""Attacks from a 1-RPM key on `tiergate serve` (issue 36's first rows), measured from outside.

A tenant limited to 1 request a minute sends chat requests back to back from several
processes, ~4 MB prompts by default (`--prompt-chars 20` makes it a flood of small 429s),
while another tenant sends short streamed chats one after the other; the same victim requests
are timed first alone. Printed: the victim's TTFT (p50/p99/max), the slowest `/health/live`
answer, the server's event-loop heartbeats more than 50 ms late (its
`tiergate_event_loop_lag_seconds`, read as `tiergate bench serve` reads it), what the attacker
got, and the usage-ledger rows written during the phase (and the requests they stand for).

The server is `tiergate serve --model demo` started in the current directory (the benchmark's
BenchServer), so running this file from another checkout's directory measures that checkout:

    cd OTHER_CHECKOUT && python /path/to/tiergate/ops/bench/attack_prompts.py [--seed 0]
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import multiprocessing
import os
import random
import sqlite3
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from bench.serve.demo_server import demo_server
from bench.serve.engine_activity import read_engine_activity
from bench.serve.provision import TENANT_PREFIX, provision_tenants
from bench.serve.victim import victim_chat
from bench.stats import Percentiles

_WORDS = [
    "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be",
    "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have",
]
_MODEL = "tiergate-demo"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--victim-requests", type=int, default=20)
    parser.add_argument("--attackers", type=int, default=3)
    parser.add_argument("--prompt-chars", type=int, default=4_000_000)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--attacker-nice", type=int, default=0,
                        help="niceness of the attacking processes: 19 leaves the cores to the "
                             "server first, separating what the attack costs the server from "
                             "the CPU the attacking clients take on a host they share")
    args = parser.parse_args()
    rng = random.Random(args.seed)
    words: list[str] = []
    size = 0
    while size < args.prompt_chars:
        words.append(rng.choice(_WORDS))
        size += len(words[-1]) + 1
    attack_body = json.dumps({
        "model": _MODEL, "max_tokens": 1,
        "messages": [{"role": "user", "content": " ".join(words)[: args.prompt_chars]}],
    }).encode()
    with demo_server("tiered") as server:
        keys = provision_tenants(
            server.base_url, server.admin_token,
            {"attacker": "standard", "victim": "standard"},
            quotas={"attacker": {"requests_per_minute": 1}},
        )
        rows = [
            _phase(server.base_url, phase, keys["victim"], keys["attacker"], attack_body,
                   num_attackers, args.victim_requests, server.work_dir / "tiergate.db",
                   args.attacker_nice)
            for phase, num_attackers in (("alone", 0), ("under attack", args.attackers))
        ]
    print(f"attack: {args.attackers} processes x {len(attack_body):,}-byte chat bodies, "
          f"1-RPM key ({TENANT_PREFIX}attacker); victim: {args.victim_requests} streamed chats "
          f"one after another, max_tokens 8 (demo model, seed {args.seed}); attackers at "
          f"nice {args.attacker_nice}")
    header = ("phase", "victim TTFT p50 ms", "p99 ms", "max ms", "/health/live max ms",
              "loop beats > 50 ms late", "attacker answers", "ledger rows (requests)")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for row in rows:
        print("| " + " | ".join(row) + " |")


def _phase(
    base_url: str, name: str, victim_key: str, attacker_key: str, attack_body: bytes,
    num_attackers: int, num_requests: int, database: Path, attacker_nice: int = 0,
) -> tuple[str, ...]:
    ledger_before = _ledger_rows(database)
    stop = threading.Event()
    live_s: list[float] = []

    def probe_live() -> None:
        with httpx.Client(base_url=base_url, timeout=120) as client:
            while not stop.is_set():
                start = time.perf_counter()
                client.get("/health/live")
                live_s.append(time.perf_counter() - start)
                time.sleep(0.1)

    activity_before = read_engine_activity(base_url)
    # Attackers in processes of their own: in this one they would take the GIL from the
    # victim's client and inflate its TTFT.
    context = multiprocessing.get_context("spawn")
    stop_attack = context.Event()
    answers_queue: multiprocessing.Queue[dict[str, int]] = context.Queue()
    sending = context.Semaphore(0)  # released by each attacker as it starts sending
    attackers = [
        context.Process(
            target=_attack,
            args=(base_url, attacker_key, attack_body, stop_attack, sending, answers_queue,
                  attacker_nice),
        )
        for _ in range(num_attackers)
    ]
    for attacker in attackers:
        attacker.start()
    for _ in attackers:  # a spawned process takes a while to import its client
        assert sending.acquire(timeout=120), "an attacker did not start"
    prober = threading.Thread(target=probe_live)
    prober.start()
    time.sleep(2.0 if num_attackers else 0.0)  # the attack under way
    ttfts = [_victim_ttft(base_url, victim_key, index) for index in range(num_requests)]
    stop.set()
    stop_attack.set()
    answers: collections.Counter[str] = collections.Counter()
    for _ in attackers:
        answers.update(answers_queue.get(timeout=300))
    for attacker in attackers:
        attacker.join()
    prober.join()
    activity_after = read_engine_activity(base_url)
    late = (
        "-" if activity_before is None or activity_after is None
        else str(activity_after.minus(activity_before).num_late_beats)
    )
    ttft = Percentiles.of(ttfts)
    time.sleep(2.0)  # refusals are written a second at a time
    rows, requests = (after - before for after, before in zip(
        _ledger_rows(database), ledger_before, strict=True))
    return (
        name, _ms(ttft.p50), _ms(ttft.p99), _ms(max(ttfts)), _ms(max(live_s)), late,
        ", ".join(f"{count} x {code}" for code, count in sorted(answers.items())) or "-",
        f"{rows:,} ({requests:,})",
    )


def _ledger_rows(database: Path) -> tuple[int, int]:
    """Rows in the server's usage_records, and the requests they stand for (one a row before
    refusals were folded)."""
    with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
        columns = {row[1] for row in db.execute("PRAGMA table_info(usage_records)")}
        requests = "sum(num_requests)" if "num_requests" in columns else "count(*)"
        num_rows, num_requests = db.execute(
            f"SELECT count(*), coalesce({requests}, 0) FROM usage_records"
        ).fetchone()
    return int(num_rows), int(num_requests)


def _victim_ttft(base_url: str, key: str, index: int) -> float:
    """Seconds from sending one short streamed chat to its first content chunk."""
    return victim_chat(base_url, key, index, model=_MODEL, timeout_s=120).ttft_s


def _attack(
    base_url: str, key: str, body: bytes, stop: Any, sending: Any, answers_queue: Any,
    nice: int,
) -> None:
    """One attacker connection sending the body back to back until stop is set."""
    os.nice(nice)
    answers: collections.Counter[str] = collections.Counter()
    headers = {"authorization": f"Bearer {key}", "content-type": "application/json"}
    with httpx.Client(base_url=base_url, timeout=120) as client:
        sending.release()
        while not stop.is_set():
            try:
                response = client.post("/v1/chat/completions", content=body, headers=headers)
                answers[str(response.status_code)] += 1
            except httpx.HTTPError as exc:
                answers[type(exc).__name__] += 1
    answers_queue.put(dict(answers))


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f}"


if __name__ == "__main__":
    main()
