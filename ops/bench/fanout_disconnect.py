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
import json
import multiprocessing
import random
import socket
import sqlite3
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx

from bench.serve.provision import TENANT_PREFIX, provision_tenants
from bench.serve.server import VARIANTS, BenchServer, EngineLimits
from bench.stats import Percentiles
from gateway.server.settings import GatewaySettings
from policies import TierTable

_MODEL = "tiergate-demo"
_SAMPLE_EVERY_S = 0.05
_SETTLE_S = 5.0
_WORDS = [
    "the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with", "be",
    "by", "on", "not", "he", "this", "are", "or", "his", "from", "at", "which", "but", "have",
]


@dataclass
class _Rss:
    """Resident KiB of the server's two processes."""

    gateway_kib: int
    engine_kib: int


@dataclass
class _Victim:
    """One victim chat: seconds to its first token, and its largest gap between two."""

    ttft_s: float
    max_gap_s: float


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
    limits = EngineLimits(model_dir=None, demo_model_dir=GatewaySettings().demo_model_dir)
    with tempfile.TemporaryDirectory() as work, BenchServer(
        VARIANTS["tiered-noshed"], TierTable(), limits, Path(work)
    ) as server:
        assert server.process is not None
        keys = provision_tenants(server.base_url, server.admin_token,
                                 {"attacker": "standard", "victim": "standard"})
        over_cap = _status_of(server.base_url, keys["attacker"],
                              {**body, "prompt": [*prompts, prompts[0]], "stream": False})
        victim = _VictimClient(server.base_url, keys["victim"], args.victim_tokens)
        victim.chat()  # warm-up
        sampler = _RssSampler(server.process.pid)
        rows: list[tuple[str, _Rss, list[_Victim]]] = []
        rows.append(("alone", sampler.sample(),
                     [victim.chat() for _ in range(args.victim_requests)]))
        first_event_s: list[float] = []
        for index in range(args.rounds):
            sampler.start()
            attack_s, round_first_event_s = _attack_phase(
                server, keys["attacker"], body, args, victim)
            first_event_s += round_first_event_s
            rows.append((f"round {index + 1}: attack (peak RSS)", sampler.stop(), attack_s))
            time.sleep(_SETTLE_S)
            rows.append((f"round {index + 1}: after, +{_SETTLE_S:g} s", sampler.sample(),
                         [victim.chat() for _ in range(args.victim_requests)]))
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
    victim: _VictimClient,
) -> tuple[list[_Victim], list[float]]:
    """The victim's chats while the attacker runs (at least --victim-requests), and the
    seconds each attacking request took to its first event."""
    # The attacker in a process of its own, so that it does not take the GIL from the victim.
    context = multiprocessing.get_context("spawn")
    results: multiprocessing.Queue[list[float]] = context.Queue()
    attacker = context.Process(target=_attack, args=(
        server.port, key, body, args.repeats, args.close_after, results))
    attacker.start()
    chats: list[_Victim] = []
    finished: list[float] = []
    waiter = threading.Thread(target=lambda: finished.extend(results.get(timeout=1200)))
    waiter.start()
    while waiter.is_alive() or len(chats) < args.victim_requests:
        chats.append(victim.chat())
    waiter.join()
    attacker.join()
    return chats, finished


def _attack(port: int, key: str, body: dict[str, Any], num_repeats: int, close_after: str,
            results: Any) -> None:
    """num_repeats attacking requests, each closed after its first event (or status line)."""
    payload = json.dumps(body).encode()
    request = (
        b"POST /v1/completions HTTP/1.1\r\nhost: tiergate\r\n"
        + f"authorization: Bearer {key}\r\ncontent-type: application/json\r\n".encode()
        + f"content-length: {len(payload)}\r\n\r\n".encode() + payload
    )
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


class _VictimClient:
    """Streamed chats of one tenant, one after another."""

    def __init__(self, base_url: str, key: str, num_tokens: int) -> None:
        self._base_url = base_url
        self._key = key
        self._num_tokens = num_tokens
        self._num_sent = 0

    def chat(self) -> _Victim:
        body = {"model": _MODEL, "max_tokens": self._num_tokens, "stream": True,
                "ignore_eos": True,
                "messages": [{"role": "user", "content": f"question {self._num_sent}: hello"}]}
        self._num_sent += 1
        times: list[float] = []
        with httpx.Client(base_url=self._base_url, timeout=600) as client:
            start = time.perf_counter()
            with client.stream("POST", "/v1/chat/completions", json=body,
                               headers={"authorization": f"Bearer {self._key}"}) as response:
                response.raise_for_status()
                for line in response.iter_lines():
                    if line.startswith("data: ") and '"content"' in line:
                        times.append(time.perf_counter())
        assert len(times) >= 2, "fewer than two content chunks"
        return _Victim(times[0] - start, max(b - a for a, b in itertools.pairwise(times)))


class _RssSampler:
    """Samples VmRSS of the gateway process and of the engine's (its child that runs
    multiprocessing's spawn_main) every _SAMPLE_EVERY_S in a thread between start() and
    stop(), which returns each one's peak."""

    def __init__(self, gateway_pid: int) -> None:
        self._gateway_pid = gateway_pid
        self._engine_pid = _engine_pid(gateway_pid)
        self._peak = _Rss(0, 0)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def sample(self) -> _Rss:
        return _Rss(_vm_rss_kib(self._gateway_pid), _vm_rss_kib(self._engine_pid))

    def start(self) -> None:
        self._peak = _Rss(0, 0)
        self._stop.clear()
        self._thread = threading.Thread(target=self._run)
        self._thread.start()

    def stop(self) -> _Rss:
        assert self._thread is not None
        self._stop.set()
        self._thread.join()
        return self._peak

    def _run(self) -> None:
        while not self._stop.is_set():
            rss = self.sample()
            self._peak = _Rss(max(self._peak.gateway_kib, rss.gateway_kib),
                              max(self._peak.engine_kib, rss.engine_kib))
            time.sleep(_SAMPLE_EVERY_S)


def _engine_pid(gateway_pid: int) -> int:
    for path in Path(f"/proc/{gateway_pid}/task").glob("*/children"):
        for child in path.read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise RuntimeError(f"no engine process under the server (pid {gateway_pid})")


def _vm_rss_kib(pid: int) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")


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
