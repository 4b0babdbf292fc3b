"""Streams that are never read (issue 36's row "100 streams that never read: gateway RSS per
stream; drain time"): what holding them costs the server, how long until it has let them all
go, and what they do to another tenant's time to first token.

One `tiergate serve --model demo` (the benchmark's BenchServer, started in the current
directory, tiered without shedding; `--write-timeout` sets its `--stream-write-timeout`, the
server's default otherwise). A victim tenant sends `--victim-requests` short streamed chats one
after another, alone; then a second tenant opens `--streams` streamed chats from raw sockets
with small receive buffers (`--rcvbuf` bytes) that never read (max_tokens `--max-tokens`,
ignore_eos, top_logprobs 20 so that every chunk is large and the buffers fill fast), and the
victim keeps sending until the server has aborted and recorded every silent stream (its
usage-ledger row, written once the engine has dropped the request); `--rounds` such batches,
one after another. Sampled every 50 ms: the resident memory (VmRSS) of the gateway process and
of the engine's process, and the bytes the kernel holds in the send queues of the server's
connections (outside both RSS figures; the server holds each connection's SO_SNDBUF to
gateway/http/protocol.py's SEND_BUFFER_BYTES, where the kernel would grow it up to
net.ipv4.tcp_wmem's maximum). Printed: each figure before, at its peak while the
streams were held and after they were drained and the server had settled; the growth per
stream; the drain time (from the first stream sent to the last one's ledger row); the
victim's TTFT alone and while the streams were held; the tokens generated for the silent
streams; how many of the server's connections were still established after each drain; and
what the silent clients found in their buffers once drained.

    python ops/bench/silent_streams.py [--seed 0]
"""

from __future__ import annotations

import argparse
import contextlib
import os
import random
import socket
import sqlite3
import threading
import time
from collections import Counter
from dataclasses import dataclass
from pathlib import Path

import httpx

from bench.serve.demo_server import demo_server
from bench.serve.peak_sampler import PeakSampler
from bench.serve.process_memory import ServerRssReader
from bench.serve.provision import TENANT_PREFIX, provision_tenants
from bench.serve.raw_client import post_request, unread_stream
from bench.serve.server import BenchServer
from bench.serve.victim import victim_chat
from bench.stats import Percentiles
from gateway.server.settings import GatewaySettings

_MODEL = "tiergate-demo"
_SAMPLE_EVERY_S = 0.05
_SETTLE_S = 5.0
_DRAIN_WAIT_S = 1800.0
_LISTEN = "0A"  # socket states in /proc/net/tcp
_ESTABLISHED = "01"
_WORDS = ["tell", "me", "a", "long", "story", "about", "the", "sea", "and", "its", "ships"]


@dataclass(frozen=True)
class _Usage:
    """The server's memory at one time (or each figure's peak), read by _read_usage."""

    gateway_kib: int  # VmRSS of the gateway process
    engine_kib: int  # VmRSS of the engine's process
    send_queue_bytes: int  # kernel send queues of the server's connections


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--streams", type=int, default=100)
    parser.add_argument("--max-tokens", type=int, default=4000)
    parser.add_argument("--rcvbuf", type=int, default=4096, help="silent sockets' SO_RCVBUF")
    parser.add_argument("--write-timeout", type=float, default=None,
                        help="the server's --stream-write-timeout (default: the server's)")
    parser.add_argument("--rounds", type=int, default=1, help="batches of silent streams")
    parser.add_argument("--victim-requests", type=int, default=20)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args()
    rng = random.Random(args.seed)
    prompts = [" ".join(rng.choice(_WORDS) for _ in range(12)) for _ in range(args.streams)]
    write_timeout_s = (GatewaySettings().stream_write_timeout_s if args.write_timeout is None
                       else args.write_timeout)
    os.environ["TIERGATE_STREAM_WRITE_TIMEOUT_S"] = str(write_timeout_s)  # the server's env
    with demo_server("tiered-noshed") as server:
        assert server.process is not None
        keys = provision_tenants(server.base_url, server.admin_token,
                                 {"silent": "standard", "victim": "standard"})
        _victim_ttft(server.base_url, keys["victim"], -1)  # warm-up
        rss = ServerRssReader(server.process.pid)
        sampler = PeakSampler(lambda: _read_usage(rss, server.port), _SAMPLE_EVERY_S)
        before = sampler.sample()
        alone = [_victim_ttft(server.base_url, keys["victim"], i)
                 for i in range(args.victim_requests)]
        rounds = [_round(server, keys, prompts, sampler, index, args)
                  for index in range(args.rounds)]
        statuses = _silent_rows(server.work_dir / "tiergate.db")
        running = _running_and_waiting(server.base_url)
    print(f"{args.streams} streamed chats never read (SO_RCVBUF {args.rcvbuf}, max_tokens "
          f"{args.max_tokens}, ignore_eos, top_logprobs 20), {args.rounds} round(s); server "
          f"--stream-write-timeout {write_timeout_s:g} s; victim: short streamed chats one "
          f"after another, max_tokens 8 (demo model, seed {args.seed})")
    header = ("phase", "gateway RSS MiB", "engine RSS MiB", "server send queues MiB",
              "victim TTFT p50 ms", "p99 ms", "max ms", "victim requests", "drain s")
    print("| " + " | ".join(header) + " |")
    print("|" + "---|" * len(header))
    _print_row("before (victim alone)", before, alone, None)
    for index, held in enumerate(rounds):
        _print_row(f"round {index + 1}: streams held (peak)", held.peak, held.ttfts_s,
                   held.drain_s)
        _print_row(f"round {index + 1}: drained, +{_SETTLE_S:g} s", held.after, None, None)
    first = rounds[0]
    print(f"per stream, round 1's peak - before: gateway "
          f"{(first.peak.gateway_kib - before.gateway_kib) / args.streams:.0f} KiB, engine "
          f"{(first.peak.engine_kib - before.engine_kib) / args.streams:.0f} KiB, server send "
          f"queues {first.peak.send_queue_bytes / 1024 / args.streams:.0f} KiB")
    print(f"drain: from the first stream sent to the last one's ledger row; ledger rows of "
          f"{TENANT_PREFIX}silent: " + ", ".join(
              f"{count} x {status} ({tokens / count:,.0f} tokens generated each)"
              for status, (count, tokens) in sorted(statuses.items()))
          + f"; requests running + waiting after: {running}; server connections still "
          f"established {_SETTLE_S:g} s after each drain: "
          + ", ".join(str(held.num_open_after) for held in rounds))
    left = [item for held in rounds for item in held.left]
    num_bytes = Percentiles.of([float(size) for _, size in left])
    print(f"what the silent clients found once drained: "
          f"{_counts(Counter(ending for ending, _ in left))}; {num_bytes.p50 / 1024:,.0f} KiB "
          f"each (p50), {max(size for _, size in left) / 1024:,.0f} KiB at most")


@dataclass
class _Round:
    """One batch of silent streams, from sending them to their drain."""

    peak: _Usage  # each figure's largest sample while the streams were held
    after: _Usage  # _SETTLE_S after the last one's ledger row
    ttfts_s: list[float]  # the victim's, meanwhile
    drain_s: float | None  # first stream sent to the last ledger row; None: not within wait
    num_open_after: int  # the server's connections still established at `after`
    left: list[tuple[str, int]]  # per silent client, _read_what_is_left


def _round(
    server: BenchServer, keys: dict[str, str], prompts: list[str],
    sampler: PeakSampler[_Usage], index: int, args: argparse.Namespace,
) -> _Round:
    database = server.work_dir / "tiergate.db"
    num_recorded = index * len(prompts)  # the silent tenant's rows from earlier rounds
    sampler.start()
    started = time.monotonic()
    silent = [_silent_stream(server.port, keys["silent"], prompt, args) for prompt in prompts]
    drained = threading.Event()
    drain_s: list[float] = []

    def watch_ledger() -> None:
        deadline = started + _DRAIN_WAIT_S
        while time.monotonic() < deadline:
            rows = sum(count for count, _ in _silent_rows(database).values())
            if rows >= num_recorded + len(prompts):
                drain_s.append(time.monotonic() - started)
                break
            time.sleep(_SAMPLE_EVERY_S)
        drained.set()

    watcher = threading.Thread(target=watch_ledger)
    watcher.start()
    ttfts_s: list[float] = []
    while not drained.is_set() or len(ttfts_s) < args.victim_requests:
        ttfts_s.append(_victim_ttft(server.base_url, keys["victim"], len(ttfts_s)))
    watcher.join()
    time.sleep(_SETTLE_S)
    peak = sampler.stop()
    after = sampler.sample()
    num_open = _num_established(server.port)
    left = [_read_what_is_left(sock) for sock in silent]
    return _Round(peak, after, ttfts_s, drain_s[0] if drain_s else None, num_open, left)


def _print_row(name: str, usage: _Usage, ttfts_s: list[float] | None,
               drain_s: float | None) -> None:
    ttft = Percentiles.of(ttfts_s or [])
    cells = (
        f"{usage.gateway_kib / 1024:.1f}", f"{usage.engine_kib / 1024:.1f}",
        f"{usage.send_queue_bytes / (1 << 20):.1f}",
        *((_ms(ttft.p50), _ms(ttft.p99), _ms(max(ttfts_s)), str(len(ttfts_s)))
          if ttfts_s else ("-",) * 4),
        "-" if drain_s is None else f"{drain_s:.1f}",
    )
    print(f"| {name} | " + " | ".join(cells) + " |")


def _read_usage(rss: ServerRssReader, port: int) -> _Usage:
    """VmRSS of the server's two processes, and the bytes its sockets on port hold in their
    kernel send queues (sent and not acknowledged, or not sent)."""
    memory = rss.read()
    return _Usage(memory.gateway_kib, memory.engine_kib, _send_queue_bytes(port))


def _num_established(port: int) -> int:
    """The server's established connections (the victim's are closed by then)."""
    return sum(1 for fields in _tcp_connections(port) if fields[3] == _ESTABLISHED)


def _send_queue_bytes(port: int) -> int:
    """tx_queue summed over the IPv4 TCP connections whose local port is port (proc(5),
    /proc/net/tcp), those the server has closed included: the kernel keeps their unsent
    bytes until the client reads them or the connection is reset."""
    return sum(int(fields[4].split(":")[0], 16) for fields in _tcp_connections(port))


def _tcp_connections(port: int) -> list[list[str]]:
    """The /proc/net/tcp rows, split, of the non-listening sockets whose local port is port."""
    rows = [line.split() for line in Path("/proc/net/tcp").read_text().splitlines()[1:]]
    return [fields for fields in rows
            if int(fields[1].rsplit(":", 1)[1], 16) == port and fields[3] != _LISTEN]


def _silent_stream(port: int, key: str, prompt: str, args: argparse.Namespace) -> socket.socket:
    """A streamed chat sent from a socket that will not read its answer until drained."""
    body = {
        "model": _MODEL, "max_tokens": args.max_tokens, "stream": True, "ignore_eos": True,
        "logprobs": True, "top_logprobs": 20, "messages": [{"role": "user", "content": prompt}],
    }
    return unread_stream(port, post_request("/v1/chat/completions", key, body), args.rcvbuf)


def _read_what_is_left(sock: socket.socket) -> tuple[str, int]:
    """How the server left a silent stream (its status line and how the bytes ended), and
    how many bytes it had sent."""
    sock.settimeout(5.0)
    data = bytearray()
    with contextlib.suppress(OSError):
        while chunk := sock.recv(1 << 16):
            data += chunk
    sock.close()
    status = data.split(b"\r\n", 1)[0].decode(errors="replace") or "nothing"
    if b"data: [DONE]" in data:
        return f"{status}, [DONE]", len(data)
    return (f"{status}, cut" if data.startswith(b"HTTP/1.1 200") else status), len(data)


def _silent_rows(database: Path) -> dict[str, tuple[int, int]]:
    """The silent tenant's ledger rows by status: how many, and their completion tokens."""
    with contextlib.closing(sqlite3.connect(f"file:{database}?mode=ro", uri=True)) as db:
        rows = db.execute(
            "SELECT u.status, count(*), sum(u.num_completion_tokens) FROM usage_records u "
            "JOIN tenants t ON t.id = u.tenant_id WHERE t.name = ? GROUP BY u.status",
            (TENANT_PREFIX + "silent",),
        ).fetchall()
    return {str(status): (int(count), int(tokens)) for status, count, tokens in rows}


def _running_and_waiting(base_url: str) -> int:
    """Requests the engine runs or queues, summed over tiers (/metrics)."""
    text = httpx.get(f"{base_url}/metrics", timeout=30).text
    return int(sum(
        float(line.rsplit(" ", 1)[1]) for line in text.splitlines()
        if line.startswith(("tiergate_requests_running{", "tiergate_requests_waiting{"))
    ))


def _victim_ttft(base_url: str, key: str, index: int) -> float:
    """Seconds from sending one short streamed chat to its first content chunk."""
    return victim_chat(base_url, key, index, model=_MODEL).ttft_s


def _counts(counter: Counter[str]) -> str:
    return ", ".join(f"{count} x {name}" for name, count in sorted(counter.items())) or "none"


def _ms(seconds: float) -> str:
    return f"{seconds * 1000:,.0f}"


if __name__ == "__main__":
    main()
