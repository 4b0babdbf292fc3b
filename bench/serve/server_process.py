"""A server subprocess the benchmarks start themselves: a free loopback port, its log in a work
directory, ready once a health path answers 200, SIGTERM (then SIGKILL) to stop, and the CPU
time of its process tree. `tiergate bench serve` (server.BenchServer) and `tiergate bench peer`
(peer_servers) subclass it with their commands and environments.
"""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import time
from pathlib import Path
from types import TracebackType
from typing import Self

from bench.serve.errors import ServerStartError

__all__ = ["ServerProcess", "free_port", "process_tree_cpu_s"]


class ServerProcess:
    """A server subprocess with its log in work_dir; a context manager. Subclasses give the
    command, and may change the environment, the name, the log file and the ready path."""

    name = "server"  # in error messages, and the log file's name
    ready_path = "/health"

    def __init__(self, work_dir: Path, *, start_timeout_s: float) -> None:
        self.work_dir = work_dir
        self.start_timeout_s = start_timeout_s
        self.port = 0
        self.process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    @property
    def log_path(self) -> Path:
        return self.work_dir / f"{self.name}.log"

    def command(self) -> list[str]:
        raise NotImplementedError

    def env(self) -> dict[str, str]:
        return dict(os.environ)

    def cwd(self) -> Path | None:
        """The working directory to start in (None: this process's)."""
        return None

    def start(self) -> Self:
        """Start on a free port and return once ready_path answers 200."""
        self.work_dir.mkdir(parents=True, exist_ok=True)
        self.port = free_port()
        with self.log_path.open("wb") as log:
            self.process = subprocess.Popen(
                self.command(), env=self.env(), cwd=self.cwd(), stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # a Ctrl-C reaches the benchmark, which stops us
            )
        try:
            self._wait_ready()
            self.after_ready()
        except BaseException:
            self.stop(timeout_s=10.0)
            raise
        return self

    def after_ready(self) -> None:
        """What a server needs once it answers (a tenant and its key, say)."""

    def stop(self, timeout_s: float = 60.0) -> int | None:
        """SIGTERM (a tiergate server drains and exits 0), SIGKILL after timeout_s; the exit
        code, None if never started."""
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

    def cpu_time_s(self) -> float | None:
        """CPU seconds of the server and the processes it started (None: not running)."""
        return None if self.process is None else process_tree_cpu_s(self.process.pid)

    def log_tail(self, num_lines: int = 30) -> str:
        try:
            lines = self.log_path.read_text(errors="replace").splitlines()
        except OSError:
            return ""
        return "\n".join(lines[-num_lines:])

    def __enter__(self) -> Self:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 traceback: TracebackType | None) -> None:
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
                        f"{self.name} exited with {code} before it was ready; end of "
                        f"{self.log_path}:\n{self.log_tail()}"
                    )
                with contextlib.suppress(httpx.TransportError):
                    if client.get(self.base_url + self.ready_path).status_code == 200:
                        return
                if time.monotonic() > deadline:
                    raise ServerStartError(
                        f"{self.name} not ready after {self.start_timeout_s:.0f} s; end of "
                        f"{self.log_path}:\n{self.log_tail()}"
                    )
                time.sleep(0.2)


def process_tree_cpu_s(pid: int) -> float | None:
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


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
