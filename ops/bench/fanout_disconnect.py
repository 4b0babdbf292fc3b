"""The largest fan-out, then a disconnect (issue 36's row "prompts x n fan-out, then
disconnect: engine stall seconds; engine RSS growth"): does a tenant that asks for as many
sequences as one request may start and leaves at once stall another tenant's decoding, or
leave memory behind in the engine?

One `tiergate serve --model demo` (the benchmark's BenchServer, started in the current
directory, tiered without shedding). The server takes at most `--max-choices` (256 by
default) prompts x n in one request; the attack asks for all of them: `--n` samples of each of
256 / n distinct prompts of `--prompt-words` random words, max_tokens `--max-tokens`,
ignore_eos, streamed, on a raw socket that is closed as soon as the first event arrives
(`--close-after token`; `headers`: as soon as the response's status line does), `--repeats`
times one after another from a process of its own; `--rounds` such attacks, each followed by
a pause. A victim tenant sends streamed chats of `--victim-tokens` tokens one after another:
alone, while each attack runs, and after each pause. Printed per phase: the victim's TTFT
p50/p99 and its largest gap between two tokens (the engine's stall as the victim sees it), and
the resident memory (VmRSS, sampled every 50 ms: the peak during an attack, the value after a
pause) of the engine's process and of the gateway's, so that growth repeated each round
shows; then the attacker's ledger rows by status, with the tokens and engine seconds they
were billed.

    python ops/bench/fanout_disconnect.py [--seed 0]
"""

from __future__ import annotations

import argparse
import contextlib
import itertools
import math
import multiprocessing
import random
import socket
import sqlite3
import threading
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import httpx

from bench.serve.demo_server import demo_server
from bench.serve.peak_sampler import PeakSampler
from bench.serve.process_memory import ServerRss, ServerRssReader
from bench.serve.provision import TENANT_PREFIX, provision_tenants
from bench.serve.raw_client import post_request
from bench.serve.server import BenchServer
from bench.serve.victim import VictimChat, victim_chat
from bench.stats import Percentiles
from gateway.server.settings import GatewaySettings

_MODEL = "tiergate-demo"
_SAMPLE_EVERY_S = 0.05
_SETTLE_S = 5.0
_WORDS = [
    "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be",
    "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have",
]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--n", type=int, default=16, help="samples of each prompt")
    parser.add_argument("--prompt-words", type=int, default=2000)
    parser.add_argument("--max-tokens", type=int, default=512)
    parser.add_argument("--repeats", type=int, default=200,
                        help="attacking requests a round")
    parser.add_argument("--rounds", type=int, default=2, help="attacks, each then a pause")
    parser.add_argument("--close-after", choices=("token", "headers"), default="token")
    parser.add_argument("--victim-requests", type=int, default=20)
    parser.add_argument("--victim-tokens", type=int, default=32)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    max_choices = GatewaySettings().max_choices
    num_prompts = max_choices // args.n
    prompts = [" ".join(rng.choice(_WORDS) for _ in range(args.prompt_words))
               for _ in range(num_prompts)]
    body = {"model": _MODEL, "prompt": prompts, "n": args.n, "max_tokens": args.max_tokens,
            "ignore_eos": True, "stream": True}
    with demo_server("tiered-noshed") as server:
        assert server.process is not None
        keys = provision_tenants(server.base_url, server.admin_token,
                                 {"attacker": "standard", "victim": "standard"})
        over_cap = _status_of(server.base_url, keys["attacker"],
                              {**body, "prompt": [*prompts, prompts[0]], "stream": False})
        victim = _victim_client(server.base_url, keys["victim"], args.victim_tokens)
        victim()  # warm-up
        sampler = PeakSampler(ServerRssReader(server.process.pid).read, _SAMPLE_EVERY_S)
        rows: list[tuple[str, ServerRss, list[VictimChat]]] = []
        rows.append(("alone", sampler.sample(),
                     [victim() for _ in range(args.victim_requests)]))
        first_event_s: list[float] = []
        for index in range(args.rounds):
            sampler.start()
            attack_s, round_first_event_s = _attack_phase(
                server, keys["attacker"], body, args, victim)
            first_event_s += round_first_event_s
            rows.append((f"round {index + 1}: attack (peak RSS)", sampler.stop(), attack_s))
            time.sleep(_SETTLE_S)
            rows.append((f"round {index + 1}: after, +{_SETTLE_S:g} s", sampler.sample(),
                         [victim() for _ in range(args.victim_requests)]))
        time.sleep(2.0)  # the last records written
        ledger = _attacker_rows(server.work_dir / "tiergate.db")
    print(f"attack: {args.rounds} x {args.repeats} streamed completions one after another, "
          f"{num_prompts} prompts of {args.prompt_words} words x n={args.n} = "
          f"{num_prompts * args.n} choices "
          f"(the server's cap; {num_prompts * args.n + args.n} answered {over_cap}), max_tokens "
          f"{args.max_tokens}, ignore_eos, socket closed after the first "
          f"{'event' if args.close_after == 'token' else 'status line'} (came after "
          f"{_ms(Percentiles.of(first_event_s).p50)} ms p50, {_ms(max(first_event_s))} ms max); "
          f"victim: streamed chats of {args.victim_tokens} tokens one after another (demo "
          f"model, seed {args.seed})")
    header = ("phase", "victim TTFT p50 ms", "p99 ms", "largest token gap ms", "victim requests",
              "engine RSS MiB", "gateway RSS MiB")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    for name, rss, chats in rows:
        ttft = Percentiles.of([chat.ttft_s for chat in chats])
        print(f"| {name} | {_ms(ttft.p50)} | {_ms(ttft.p99)} | "
              f"{_ms(max(chat.max_gap_s for chat in chats))} | {len(chats)} | "
              f"{rss.engine_kib / 1024:.1f} | {rss.gateway_kib / 1024:.1f} |")
    print(f"ledger rows of {TENANT_PREFIX}attacker: " + (", ".join(
        f"{status}: {count} ({completion:,} completion tokens, {prompt:,} prompt tokens, "
        f"{gpu_s:.2f} engine s)" for status, (count, prompt, completion, gpu_s)
        in sorted(ledger.items())) or "none") + f"; {args.rounds * args.repeats} requests sent")


def _attack_phase(
    server: BenchServer, key: str, body: dict[str, Any], args: argparse.Namespace,
    victim: Callable[[], VictimChat],
) -> tuple[list[VictimChat], list[float]]:
    """The victim's chats while the attacker runs (at least --victim-requests), and the
    seconds each attacking request took to its first event."""
    # The attacker in a process of its own, so that it does not take the GIL from the victim.
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[list[float]] = context.Queue()
    attacker = context.Process(target=_attack, args=(
        server.port, key, body, args.repeats, args.close_after, results))
    attacker.start()
    chats: list[VictimChat] = []
    finished: list[float] = []
    waiter = threading.Thread(target=lambda: finished.extend(results.get(timeout=1200)))
    waiter.start()
    while waiter.is_alive() or len(chats) < args.victim_requests:
        chats.append(victim())
    waiter.join()
    attacker.join()
    return chats, finished


def _attack(port: int, key: str, body: dict[str, Any], num_repeats: int, close_after: str,
            results: Any) -> None:
    """num_repeats attacking requests, each closed after its first event (or status line)."""
    request = post_request("/v1/completions", key, body)
    first_event_s: list[float] = []
    for _ in range(num_repeats):
        with socket.create_connection(("127.0.0.1", port)) as sock:
            start = time.perf_counter()
            sock.sendall(request)
            data = b""
            until = b"\ndata: " if close_after == "token" else b"\r\n"
            while until not in data:
                chunk = sock.recv(1 << 16)
                assert chunk, f"the server closed the stream first: {data[:200]!r}"
                data += chunk
            assert data.startswith(b"HTTP/1.1 200"), data[:200]
            first_event_s.append(time.perf_counter() - start)
    results.put(first_event_s)


def _victim_client(base_url: str, key: str, num_tokens: int) -> Callable[[], VictimChat]:
    """Streamed chats of one tenant, one after another, numbered from 0."""
    numbers = itertools.count()

    def chat() -> VictimChat:
        result = victim_chat(base_url, key, next(numbers), model=_MODEL, max_tokens=num_tokens,
                             ignore_eos=True, timeout_s=600)
        assert not math.isnan(result.max_gap_s), "fewer than two content chunks"
        return result

    return chat


def _status_of(base_url: str, key: str, body: dict[str, Any]) -> int:
    response = httpx.post(f"{base_url}/v1/completions", json=body, timeout=300,
                          headers={"authorization": f"Bearer {key}"})
    return response.status_code


def _attacker_rows(database: Path) -> dict[str, tuple[int, int, int, float]]:
    """The attacker's ledger rows by status: rows, prompt and completion tokens, GPU s."""
    with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
        rows = db.execute(
            "SELECT u.status, count(*), sum(u.num_prompt_tokens), sum(u.num_completion_tokens),"
            " sum(u.gpu_seconds) FROM usage_records u JOIN tenants t ON t.id = u.tenant_id "
            "WHERE t.name = ? GROUP BY u.status",
            (TENANT_PREFIX + "attacker",),
        ).fetchall()
    return {str(status): (int(count), int(prompt), int(completion), float(gpu_s))
            for status, count, prompt, completion, gpu_s in rows}


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f}"


if __name__ == "__main__":
    main()
