"""The resident memory of a `tiergate serve` process and of its engine's (the child process
that runs multiprocessing's spawn_main), read from /proc (proc(5): VmRSS of each process's
`status`, the processes each thread started in its `children`)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

__all__ = ["ServerRss", "ServerRssReader", "engine_pid", "vm_rss_kib"]


@dataclass(frozen=True)
class ServerRss:
    """Resident KiB of the server's two processes."""

    gateway_kib: int  # VmRSS of the gateway process
    engine_kib: int  # VmRSS of the engine's process


class ServerRssReader:
    """Reads ServerRss of one running server; its engine's process is found once, here."""

    def __init__(self, gateway_pid: int) -> None:
        self.gateway_pid = gateway_pid
        self.engine_pid = engine_pid(gateway_pid)

    def read(self) -> ServerRss:
        return ServerRss(vm_rss_kib(self.gateway_pid), vm_rss_kib(self.engine_pid))


def engine_pid(gateway_pid: int) -> int:
    """The pid of the server's engine process: its child whose command line runs spawn_main."""
    for path in Path(f"/proc/{gateway_pid}/task").glob("*/children"):
        for child in path.read_text().split():
            if b"spawn_main" in Path(f"/proc/{child}/cmdline").read_bytes():
                return int(child)
    raise RuntimeError(f"no engine process under the server (pid {gateway_pid})")


def vm_rss_kib(pid: int) -> int:
    """The resident memory of process pid, in KiB."""
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1])
    raise RuntimeError(f"no VmRSS for pid {pid}")
