"""Servers the benchmark starts itself: one `tiergate serve` process per configuration, each
on a fresh SQLite database, a free loopback port and its own admin token, with the tier
table and admission section written to a `--config` YAML file.

The configurations compared (same model, same engine limits, same machine):
- `tiered`: tiergate's default, tier priorities, premium's KV reservation, SLO shedding;
- `fcfs`: one FCFS queue, no tiers, no reservation, no shedding (a vLLM-style engine);
- `tiered-noshed`: the tiered engine without SLO shedding.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import secrets
import signal
import socket
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING

import yaml

from gateway.bench_serve.errors import ServerStartError

if TYPE_CHECKING:
    from policies import TierTable

__all__ = ["VARIANTS", "BenchServer", "EngineLimits", "ServerVariant"]

_READY_PATH = "/health/ready"


@dataclass(frozen=True)
class ServerVariant:
    """One server configuration under comparison."""

    name: str  # the label in tables and JSON
    scheduling: str  # `--scheduling`: tiered or fcfs
    enable_shedding: bool  # `admission.enable_shedding` of the config file


VARIANTS: dict[str, ServerVariant] = {
    v.name: v
    for v in (
        ServerVariant("tiered", "tiered", enable_shedding=True),
        ServerVariant("fcfs", "fcfs", enable_shedding=False),
        ServerVariant("tiered-noshed", "tiered", enable_shedding=False),
    )
}


@dataclass(frozen=True)
class EngineLimits:
    """Model and engine flags every server of a comparison gets alike."""

    model_dir: Path | None  # `--model`; None: the demo model in demo_model_dir
    demo_model_dir: Path  # `--demo-model-dir` (written on first use)
    kv_cache_bytes: int = 256 << 20
    max_num_seqs: int = 64
    max_num_batched_tokens: int = 2048


class BenchServer:
    """A `tiergate serve` subprocess; use as a context manager or call start()/stop()."""

    def __init__(
        self,
        variant: ServerVariant,
        tiers: TierTable,
        limits: EngineLimits,
        work_dir: Path,
        *,
        start_timeout_s: float = 300.0,
    ) -> None:
        self.variant = variant
        self.tiers = tiers
        self.limits = limits
        self.work_dir = work_dir  # config, database, spool and log of this server
        self.start_timeout_s = start_timeout_s
        self.admin_token = "bench-" + secrets.token_urlsafe(24)
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.work_dir / "serve.log"

    def start(self) -> BenchServer:
        """Start and return once /health/ready answers 200 (the model is loaded)."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        config_path = self.work_dir / "config.yaml"
        config_path.write_text(yaml.safe_dump(self.config_file(), sort_keys=False))
        self.port = _free_port()
        limits = self.limits
        command = [
            sys.executable, "-m", "gateway.cli", "serve",
            "--host", "127.0.0.1",
            "--port", str(self.port),
            "--config", str(config_path),
            "--scheduling", self.variant.scheduling,
            "--database-url", f"sqlite:///{self.work_dir / 'tiergate.db'}",
            "--data-dir", str(self.work_dir / "data"),
            "--demo-model-dir", str(limits.demo_model_dir),
            "--kv-cache-bytes", str(limits.kv_cache_bytes),
            "--max-num-seqs", str(limits.max_num_seqs),
            "--max-num-batched-tokens", str(limits.max_num_batched_tokens),
            "--log-level", "warning",
        ]  # fmt: skip
        command += ["--model", str(limits.model_dir) if limits.model_dir is not None else "demo"]
        # The admin token only through the environment (argv shows in `ps`); no Redis: the
        # rate limiter stays in the process, as quotas are unlimited anyway.
        env = {
            # OpenMP threads that spin between parallel regions (the default) take the cores
            # from the engine: on the 2-core CI machine a server that had served one heavy
            # load then ran 3-10x slower, for good. Passive waiting, unless the caller chose.
            "OMP_WAIT_POLICY": "PASSIVE",
            **os.environ,
            "TIERGATE_ADMIN_TOKEN": self.admin_token,
            "PYTHONUNBUFFERED": "1",
        }
        env.pop("TIERGATE_REDIS_URL", None)
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                command,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C reaches the benchmark, which stops us
            )
        try:
            self._wait_ready()
        except BaseException:
            self.stop(timeout_s=10.0)
            raise
        return self

    def cpu_time_s(self) -> float | None:
        """CPU seconds the server has used so far: its process (all threads) and the
        processes it started (the engine's); None where /proc is not available or the
        server is gone."""
        if self.process is None:
            return None
        return _process_tree_cpu_s(self.process.pid)

    def config_file(self) -> dict[str, object]:
        """The `--config` contents: the tier table and the admission section."""
        return {
            "tiers": [dataclasses.asdict(tier) for tier in self.tiers],
            "admission": {"enable_shedding": self.variant.enable_shedding},
        }

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (drain, exit 0), SIGKILL after timeout_s; the exit code, None if never
        started."""
        process, self.process = self.process, None
        if process is None:
            return None
        if process.poll() is None:
            process.send_signal(signal.SIGTERM)
        try:
            return process.wait(timeout_s)
        except subprocess.TimeoutExpired:
            process.kill()
            return process.wait()

    def __enter__(self) -> BenchServer:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _wait_ready(self) -> None:
        import httpx  # not at module level: the command line imports this module

        assert self.process is not None
        deadline = time.monotonic() + self.start_timeout_s
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while True:
                code = self.process.poll()
                if code is not None:
                    raise ServerStartError(
                        f"{self.variant.name} server exited with {code} before it was ready; "
                        f"end of {self.log_path}:\n{self._log_tail()}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if client.get(self.base_url + _READY_PATH).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"{self.variant.name} server not ready after {self.start_timeout_s:.0f} "
                        f"s; end of {self.log_path}:\n{self._log_tail()}"
                    )
                time.sleep(0.2)

    def _log_tail(self, num_lines: int = 30) -> str:
        lines = self.log_path.read_text(errors="replace").splitlines()
        return "\n".join(lines[-num_lines:])


def _process_tree_cpu_s(pid: int) -> float | None:
    """utime + stime of pid and of its descendants alive now (proc(5): each thread's
    `children` file lists the processes it started); None if pid is gone."""
    total_ticks: int | None = None
    pending = [pid]
    while pending:
        current = pending.pop()
        try:
            stat = Path(f"/proc/{current}/stat").read_text().rsplit(")", 1)[1].split()
            children = [
                int(child)
                for path in Path(f"/proc/{current}/task").glob("*/children")
                for child in path.read_text().split()
            ]
        except (OSError, ValueError):  # gone meanwhile
            continue
        # utime and stime, fields 14 and 15 of proc(5), counted after the command name
        total_ticks = (total_ticks or 0) + int(stat[11]) + int(stat[12])
        pending.extend(children)
    return None if total_ticks is None else total_ticks / os.sysconf("SC_CLK_TCK")


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
