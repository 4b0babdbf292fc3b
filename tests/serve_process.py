"""A real `tiergate serve` process for tests: started with its own database, port and
demo-model directory, stopped with SIGTERM (or SIGKILL), its output kept for asserts.

A started one is a context manager, so a fixture is

    with ServeProcess(database_url, args=[...]).start() as server:
        yield server

and the server is stopped (exit status 0, or the test fails with its output) and, whatever
happened, not left running.

Shared by the gateway, admission, billing, console and deployment tests.
"""

from __future__ import annotations

import os
import re
import signal
import socket
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Mapping
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx

from engine.checkpoints.demo_model import write_demo_model

ADMIN_TOKEN = "test-admin-token-0123456789"
_KEY_PATTERN = re.compile(r"tg-[A-Za-z0-9]{8}_[A-Za-z0-9_-]+")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


_demo_dir: Path | None = None


def shared_demo_model_dir() -> Path:
    """One demo checkpoint per test session (writing it takes seconds)."""
    global _demo_dir
    if _demo_dir is None:
        _demo_dir = write_demo_model(Path(tempfile.mkdtemp(prefix="tiergate-demo-")) / "demo")
    return _demo_dir


@dataclass
class ServeProcess:
    """One replica. Call start(); base_url is valid once it returns."""

    database_url: str
    env: Mapping[str, str] = field(default_factory=dict)
    args: list[str] = field(default_factory=list)
    port: int = field(default_factory=free_port)
    log_path: Path = field(
        default_factory=lambda: Path(tempfile.mkdtemp(prefix="tiergate-serve-")) / "serve.log"
    )
    process: subprocess.Popen[bytes] | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout_s: float = 120.0) -> ServeProcess:
        env = {
            **os.environ,
            "TIERGATE_MODEL": "demo",
            "TIERGATE_DEMO_MODEL_DIR": str(shared_demo_model_dir()),
            "TIERGATE_ADMIN_TOKEN": ADMIN_TOKEN,
            "TIERGATE_DATA_DIR": tempfile.mkdtemp(prefix="tiergate-data-"),
            "PYTHONUNBUFFERED": "1",
            **self.env,
        }
        command = [
            sys.executable, "-m", "gateway.cli", "serve",
            "--port", str(self.port),
            "--database-url", self.database_url,
            "--kv-cache-bytes", str(16 << 20),
            "--log-level", "warning",
            *self.args,
        ]
        with self.log_path.open("wb") as log:  # the child keeps its own descriptor
            self.process = subprocess.Popen(
                command, env=env, stdout=log, stderr=subprocess.STDOUT
            )
        try:
            self.wait_ready(timeout_s)
        except BaseException:
            self.kill()  # not ready in time: it must not outlive the test
            raise
        return self

    def __enter__(self) -> ServeProcess:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        """Stopped with SIGTERM, which it must answer with exit status 0 (unless the block
        raised: that error is the one to see); killed if it is still running."""
        try:
            if exc_type is None and self.process is not None:
                assert self.stop() == 0, self.output()
        finally:
            self.kill()

    def wait_ready(self, timeout_s: float) -> None:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            assert self.process is not None
            if self.process.poll() is not None:
                raise RuntimeError(f"tiergate serve exited early:\n{self.output()}")
            try:
                if httpx.get(f"{self.base_url}/health/ready", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        raise RuntimeError(f"tiergate serve not ready in {timeout_s} s:\n{self.output()}")

    def output(self) -> str:
        return self.log_path.read_text(errors="replace")

    def printed_keys(self) -> list[str]:
        return sorted(set(_KEY_PATTERN.findall(self.output())))

    def stop(self, sig: int = signal.SIGTERM, timeout_s: float = 60.0) -> int:
        """Send sig and wait; returns the exit status."""
        assert self.process is not None
        if self.process.poll() is None:
            self.process.send_signal(sig)
        return self.process.wait(timeout_s)

    def kill(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.kill()
            self.process.wait(30)


def default_model_server(cache_dir: Path, database: Path,
                         dtype: str | None = None) -> ServeProcess:
    """A started replica of the default model (converted into cache_dir once), with room for
    a real model's prompts: 128 MiB of KV cache, a 2,048-token context; dtype: --dtype."""
    return ServeProcess(
        f"sqlite:///{database}",
        env={"TIERGATE_MODEL": "", "TIERGATE_MODEL_CACHE_DIR": str(cache_dir)},
        args=["--kv-cache-bytes", str(128 << 20), "--max-model-len", "2048",
              *(["--dtype", dtype] if dtype else [])],
    ).start(timeout_s=300)


def start_long_streams(
    base_url: str, key: str, count: int
) -> tuple[list[list[str]], list[threading.Thread]]:
    """count long chat streams (stream_long_chat) in threads, once all have started: the
    lines each receives, and the threads."""
    streams: list[tuple[list[str], threading.Event]] = [
        ([], threading.Event()) for _ in range(count)
    ]
    threads = [
        threading.Thread(target=stream_long_chat, args=(base_url, key, lines, started))
        for lines, started in streams
    ]
    for thread in threads:
        thread.start()
    for _, started in streams:
        assert started.wait(60)
    return [lines for lines, _ in streams], threads


def stream_long_chat(base_url: str, key: str, lines: list[str], started: threading.Event) -> None:
    """One streamed chat of 1,500 tokens (ignore_eos): each non-empty SSE line into lines,
    started set at the first. A server that goes away mid-stream ends it quietly: callers
    check what arrived and what was recorded."""
    body = {"model": "tiergate-demo", "max_tokens": 1500, "stream": True, "ignore_eos": True,
            "messages": [{"role": "user", "content": "count"}]}
    try:
        with httpx.stream("POST", f"{base_url}/v1/chat/completions", json=body,
                          headers={"authorization": f"Bearer {key}"}, timeout=120) as response:
            for line in response.iter_lines():
                if line:
                    lines.append(line)
                    started.set()
    except httpx.HTTPError:
        pass
