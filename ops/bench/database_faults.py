"""PostgreSQL faults under load (issue 36's row "PostgreSQL locked / stopped / SIGSTOPped under
load"): how long do requests take, how soon does the ledger spool, and is any success left
without its usage record?

A throwaway PostgreSQL cluster of its own (initdb in a temporary directory, a free loopback
port, trust authentication; run as the `postgres` user when this runs as root), the project's
migrations on it, and `tiergate serve --model demo` on it (the benchmark's BenchServer, tiered
without shedding, its spool in the temporary directory). `--clients` threads send short
streamed chats back to back for the whole run while the database goes through these phases,
each `--phase-s` seconds, with the load after each fault as a phase of its own (until the
spool is empty, and at least 2 s):
- baseline: nothing wrong;
- locked: another connection holds `LOCK TABLE usage_records IN ACCESS EXCLUSIVE MODE`;
- stopped: `pg_ctl stop -m fast`, then started again;
- SIGSTOPped: the postmaster and every process it started, then SIGCONT.

Printed per phase (a request counts in the fault it was in flight during, else in the phase
it was sent in): answers ending in 200 and `[DONE]` and the others, completion time (send to
the stream's end) p50/p99, seconds from the fault's start until the spool file first holds a
record (looked for until the next fault), and records lost: successes whose request id (the
chunks' `id`) is not in `usage_records` once the load has stopped and the spool has drained.

    PYTHONPATH=. python ops/bench/database_faults.py [--seed 0] [--phase-s 8] [--clients 4]

(from a checkout's directory: the server runs that checkout's code).
"""

from __future__ import annotations

import argparse
import collections
import contextlib
import json
import os
import random
import shlex
import shutil
import signal
import subprocess
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import httpx
import psycopg

import migrations
from bench.serve.provision import provision_tenants
from bench.serve.server import VARIANTS, BenchServer, EngineLimits
from bench.serve.server_process import free_port
from bench.stats import Percentiles
from gateway.server.settings import GatewaySettings
from policies import TierTable
from tenants import DatabaseSettings

_MODEL = "tiergate-demo"
_WORDS = ["the", "of", "and", "to", "in", "a", "is", "that", "for", "it", "as", "was", "with"]
_PG_BIN = Path("/usr/local/bin")
_CLIENT_TIMEOUT_S = 120.0  # a request slower than this counts as an error (ReadTimeout)
_DRAIN_TIMEOUT_S = 120.0  # the longest wait for the spool to empty after a fault


class _Cluster:
    """A PostgreSQL cluster in a temporary directory, removed on exit."""

    def __init__(self) -> None:
        self.dir = Path(tempfile.mkdtemp(prefix="tiergate-dbfaults-pg-"))
        self.port = free_port()
        # initdb refuses to run as root: the cluster then belongs to the postgres user.
        self._user = "postgres" if os.geteuid() == 0 else None
        if self._user is not None:
            shutil.chown(self.dir, self._user, self._user)
        self._frozen: list[int] = []

    @property
    def url(self) -> str:
        return f"postgresql://postgres@127.0.0.1:{self.port}/postgres"

    @property
    def sqlalchemy_url(self) -> str:
        return f"postgresql+psycopg://postgres@127.0.0.1:{self.port}/postgres"

    def __enter__(self) -> _Cluster:
        try:
            self._run("initdb", "-D", str(self.dir / "data"), "-U", "postgres", "-A", "trust",
                      "-E", "UTF8", "--no-sync")
            self.start()
        except BaseException:
            self.__exit__()
            raise
        return self

    def __exit__(self, *_exc: object) -> None:
        self.thaw()
        try:
            if (self.dir / "data" / "postmaster.pid").exists():
                self._run("pg_ctl", "-D", str(self.dir / "data"), "stop", "-m", "immediate",
                          "-w")
        finally:
            shutil.rmtree(self.dir, ignore_errors=True)

    def start(self) -> None:
        options = (f"-p {self.port} -c listen_addresses=127.0.0.1 "
                   f"-c unix_socket_directories={shlex.quote(str(self.dir))}")
        self._run("pg_ctl", "-D", str(self.dir / "data"), "-l", str(self.dir / "postgres.log"),
                  "-o", options, "-w", "start")

    def stop(self) -> None:
        self._run("pg_ctl", "-D", str(self.dir / "data"), "stop", "-m", "fast", "-w")

    def freeze(self) -> None:
        """SIGSTOP the postmaster first (it starts no process after that), then its children."""
        postmaster = int((self.dir / "data" / "postmaster.pid").read_text().split()[0])
        os.kill(postmaster, signal.SIGSTOP)
        self._frozen = [postmaster]
        children = subprocess.run(["pgrep", "-P", str(postmaster)], capture_output=True,
                                  text=True, check=False).stdout.split()
        for child in map(int, children):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGSTOP)
                self._frozen.append(child)

    def thaw(self) -> None:
        for pid in reversed(self._frozen):
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGCONT)
        self._frozen = []

    def _run(self, program: str, *args: str) -> None:
        subprocess.run([str(_PG_BIN / program), *args], user=self._user, check=True,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)


class _PostgresServer(BenchServer):
    """The benchmark's server on the cluster instead of its own SQLite file; the cluster is
    migrated beforehand."""

    def __init__(self, database_url: str, work_dir: Path) -> None:
        limits = EngineLimits(model_dir=None, demo_model_dir=GatewaySettings().demo_model_dir)
        super().__init__(VARIANTS["tiered-noshed"], TierTable(), limits, work_dir)
        self.database_url = database_url

    @property
    def spool_path(self) -> Path:
        return self.work_dir / "data" / "usage-spool.jsonl"  # --data-dir's usage spool

    def command(self) -> list[str]:
        command = super().command()
        command[command.index("--database-url") + 1] = self.database_url
        return [*command, "--no-migrate"]


@dataclass(frozen=True)
class _Answer:
    """One streamed chat, as its client saw it."""

    sent_s: float  # time.monotonic() when sent
    completion_s: float  # from sending to the stream's end (or the failure)
    request_id: str | None  # the chunks' id, which is the usage record's request_id
    error: str | None  # None: HTTP 200 ending in [DONE]; else what came instead

    @property
    def is_ok(self) -> bool:
        return self.error is None


@dataclass(frozen=True)
class _Phase:
    name: str
    start_s: float  # time.monotonic() as the fault was set off (or the phase began)
    end_s: float  # the fault gone (or the phase over)
    is_fault: bool


class _SpoolWatch:
    """Polls the spool file's size every 5 ms: the times it went from empty to not."""

    def __init__(self, path: Path) -> None:
        self._path = path
        self.spooled_at_s: list[float] = []
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)
        self._thread.start()

    def size(self) -> int:
        try:
            return self._path.stat().st_size
        except FileNotFoundError:
            return 0

    def wait_empty(self, timeout_s: float) -> bool:
        deadline = time.monotonic() + timeout_s
        while self.size() > 0:
            if time.monotonic() > deadline:
                return False
            time.sleep(0.05)
        return True

    def close(self) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        was_empty = True
        while not self._stop.wait(0.005):
            is_empty = self.size() == 0
            if was_empty and not is_empty:
                self.spooled_at_s.append(time.monotonic())
            was_empty = is_empty


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--phase-s", type=float, default=8.0,
                        help="seconds of each fault (the lock limit of serving is 5 s)")
    parser.add_argument("--clients", type=int, default=4)
    parser.add_argument("--max-tokens", type=int, default=8)
    args = parser.parse_args()
    with _Cluster() as cluster, tempfile.TemporaryDirectory() as work:
        migrations.upgrade_head(cluster.sqlalchemy_url)
        with _PostgresServer(cluster.sqlalchemy_url, Path(work)) as server:
            key = provision_tenants(server.base_url, server.admin_token, {"load": "standard"})
            spool = _SpoolWatch(server.spool_path)
            answers: list[_Answer] = []
            stop_load = threading.Event()
            clients = [
                threading.Thread(target=_client, args=(
                    server.base_url, key["load"], args.seed * 1000 + index, args.max_tokens,
                    stop_load, answers))
                for index in range(args.clients)
            ]
            for client in clients:
                client.start()
            try:
                phases = _run_phases(cluster, spool, args.phase_s)
            finally:
                cluster.thaw()
                stop_load.set()
                for client in clients:
                    client.join()
            drained = spool.wait_empty(_DRAIN_TIMEOUT_S)
            spool.close()
            stored = _stored_request_ids(cluster.url, answers)
            rejected = server.spool_path.with_name(server.spool_path.name + ".rejected")
            num_rejected = len(rejected.read_text().splitlines()) if rejected.exists() else 0
    _print(args, phases, answers, spool.spooled_at_s, stored, drained, num_rejected)


def _run_phases(cluster: _Cluster, spool: _SpoolWatch, phase_s: float) -> list[_Phase]:
    phases = [_hold("baseline", lambda: contextlib.nullcontext(), phase_s, is_fault=False)]
    faults: list[tuple[str, Callable[[], contextlib.AbstractContextManager[object]]]] = [
        ("usage_records locked", lambda: _table_locked(cluster.url)),
        ("PostgreSQL stopped", lambda: _stopped(cluster)),
        ("PostgreSQL SIGSTOPped", lambda: _frozen(cluster)),
    ]
    for name, fault in faults:
        phases.append(_hold(name, fault, phase_s, is_fault=True))
        start_s = time.monotonic()
        time.sleep(2.0)
        if not spool.wait_empty(_DRAIN_TIMEOUT_S):
            raise RuntimeError(f"the spool still holds records {_DRAIN_TIMEOUT_S:.0f} s after "
                               f"{name} ended")
        phases.append(_Phase(f"after: {name}", start_s, time.monotonic(), is_fault=False))
    return phases


def _hold(
    name: str, fault: Callable[[], contextlib.AbstractContextManager[object]], phase_s: float,
    *, is_fault: bool,
) -> _Phase:
    start_s = time.monotonic()  # from before the fault's command (pg_ctl stop takes a while)
    with fault():
        time.sleep(max(0.0, start_s + phase_s - time.monotonic()))
    return _Phase(name, start_s, time.monotonic(), is_fault)


@contextlib.contextmanager
def _table_locked(url: str) -> Iterator[None]:
    with psycopg.connect(url) as connection:
        connection.execute("LOCK TABLE usage_records IN ACCESS EXCLUSIVE MODE")
        yield
        connection.rollback()


@contextlib.contextmanager
def _stopped(cluster: _Cluster) -> Iterator[None]:
    cluster.stop()
    try:
        yield
    finally:
        cluster.start()


@contextlib.contextmanager
def _frozen(cluster: _Cluster) -> Iterator[None]:
    cluster.freeze()
    try:
        yield
    finally:
        cluster.thaw()


def _client(
    base_url: str, key: str, seed: int, max_tokens: int, stop: threading.Event,
    answers: list[_Answer],
) -> None:
    rng = random.Random(seed)
    headers = {"authorization": f"Bearer {key}"}
    with httpx.Client(base_url=base_url, timeout=_CLIENT_TIMEOUT_S, trust_env=False,
                      headers=headers) as client:
        while not stop.is_set():
            words = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16)))
            answers.append(_ask(client, words, max_tokens))


def _ask(client: httpx.Client, prompt: str, max_tokens: int) -> _Answer:
    """One streamed chat: its id, and whether it ended with [DONE] (else what instead)."""
    body = {"model": _MODEL, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True},
            "messages": [{"role": "user", "content": prompt}]}
    sent_s = time.monotonic()
    request_id = error = None
    try:
        with client.stream("POST", "/v1/chat/completions", json=body) as response:
            if response.status_code != 200:
                response.read()
                error = f"{response.status_code} {_error_code(response.json())}"
            else:
                is_done = False
                for line in response.iter_lines():
                    if not line.startswith("data: "):
                        continue
                    if line == "data: [DONE]":
                        is_done = True
                        continue
                    event = json.loads(line.removeprefix("data: "))
                    if "error" in event:
                        error = f"200, then {_error_code(event)}"
                    request_id = event.get("id", request_id)
                if error is None and not is_done:
                    error = "200, no [DONE]"
    except httpx.HTTPError as exc:
        error = type(exc).__name__
    except ValueError:
        error = "unreadable answer"
    return _Answer(sent_s, time.monotonic() - sent_s, request_id, error)


def _error_code(body: Any) -> str:
    try:
        return str(body["error"]["code"])
    except (KeyError, TypeError):
        return "?"


def _stored_request_ids(url: str, answers: list[_Answer]) -> set[str]:
    ids = [a.request_id for a in answers if a.is_ok and a.request_id is not None]
    with psycopg.connect(url, autocommit=True) as connection:
        rows = connection.execute(
            "SELECT request_id FROM usage_records WHERE request_id = ANY(%s)", (ids,)
        ).fetchall()
    return {row[0] for row in rows}


def _assign(phases: list[_Phase], answers: list[_Answer]) -> list[list[_Answer]]:
    """Each answer in the fault it was in flight during, else in the phase it was sent in."""
    by_phase: list[list[_Answer]] = [[] for _ in phases]
    for answer in answers:
        end_s = answer.sent_s + answer.completion_s
        during = [i for i, p in enumerate(phases)
                  if p.is_fault and answer.sent_s < p.end_s and end_s > p.start_s]
        sent_in = [i for i, p in enumerate(phases) if p.start_s <= answer.sent_s]
        by_phase[(during or sent_in or [0])[-1]].append(answer)
    return by_phase


def _print(
    args: argparse.Namespace, phases: list[_Phase], answers: list[_Answer],
    spooled_at_s: list[float], stored: set[str], drained: bool, num_rejected: int,
) -> None:
    limits = DatabaseSettings()
    print(f"{args.clients} clients sending streamed chats back to back (max_tokens "
          f"{args.max_tokens}, demo model, seed {args.seed}); each fault {args.phase_s:g} s; "
          f"serving's PostgreSQL limits: lock {limits.lock_timeout_s:g} s, statement "
          f"{limits.statement_timeout_s:g} s, connect {limits.connect_timeout_s:g} s")
    print("| phase | requests (ok / error) | completion p50 / p99 ms | seconds to spooling | "
          "records lost |")
    print("|---|---|---|---|---|")
    by_phase = _assign(phases, answers)
    errors: dict[str, collections.Counter[str]] = {}
    for index, phase in enumerate(phases):
        sent = by_phase[index]
        ok = [a for a in sent if a.is_ok]
        completion = Percentiles.of([a.completion_s for a in sent])
        spooling = "-"
        if phase.is_fault:  # the spool's first record, up to the next fault
            next_fault_s = min((p.start_s for p in phases[index + 1:] if p.is_fault),
                               default=float("inf"))
            first = [t - phase.start_s for t in spooled_at_s if phase.start_s <= t < next_fault_s]
            spooling = "none" if not first else f"{first[0]:.2f}" + (
                " (after the fault)" if phase.start_s + first[0] > phase.end_s else "")
        lost = sum(1 for a in ok if a.request_id not in stored)
        errors[phase.name] = collections.Counter(a.error for a in sent if a.error is not None)
        print(f"| {phase.name} ({phase.end_s - phase.start_s:.1f} s) | {len(ok)} / "
              f"{len(sent) - len(ok)} | {completion.p50 * 1000:,.0f} / "
              f"{completion.p99 * 1000:,.0f} | {spooling} | {lost} |")
    for name, counts in errors.items():
        if counts:
            shown = ", ".join(f"{count} x {error}" for error, count in counts.most_common())
            print(f"errors, {name}: {shown}")
    slowest = max(answers, key=lambda a: a.completion_s)
    print(f"slowest request: {slowest.completion_s:.2f} s; spool drained at the end: "
          f"{'yes' if drained else 'NO'}; records set aside in .rejected: {num_rejected}")


if __name__ == "__main__":
    main()
