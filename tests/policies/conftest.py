"""Redis for the rate-limiter tests: the shared local server under a per-test key prefix, and
a throwaway redis-server of the test's own that it may kill and restart.

The shared server is TIERGATE_TEST_REDIS_URL, default redis://127.0.0.1:6379/0; when it is
unreachable the tests fail: they never skip. Other test runs use the same server at the same
time, so every test writes only under its own random prefix and deletes it afterwards.
"""

from __future__ import annotations

import os
import secrets
import shutil
import signal
import socket
import subprocess
import time
from collections.abc import Iterator

import pytest
import redis

REDIS_URL = os.environ.get("TIERGATE_TEST_REDIS_URL", "redis://127.0.0.1:6379/0")


class ThrowawayRedis:
    """A redis-server subprocess on a free loopback port, without persistence."""

    def __init__(self) -> None:
        with socket.socket() as probe:
            probe.bind(("127.0.0.1", 0))
            self.port = probe.getsockname()[1]
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self._process: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        executable = shutil.which("redis-server")
        assert executable is not None, "redis-server is not installed"
        self._process = subprocess.Popen(
            [
                executable,
                "--port",
                str(self.port),
                "--bind",
                "127.0.0.1",
                "--save",
                "",
                "--appendonly",
                "no",
                "--daemonize",
                "no",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        client = redis.Redis.from_url(self.url, socket_timeout=2, socket_connect_timeout=2)
        # a loaded machine may take seconds to answer: a timed-out PING is tried again too
        deadline_s = time.monotonic() + 30
        try:
            while True:
                try:
                    client.ping()
                    return
                except (redis.ConnectionError, redis.TimeoutError):
                    assert self._process.poll() is None, "redis-server exited at start"
                    assert time.monotonic() < deadline_s, "redis-server did not start in 30 s"
                    time.sleep(0.02)
        finally:
            client.close()

    def pause(self) -> None:
        """Freeze the server (SIGSTOP): connections stay open but nothing answers."""
        assert self._process is not None
        self._process.send_signal(signal.SIGSTOP)

    def resume(self) -> None:
        assert self._process is not None
        self._process.send_signal(signal.SIGCONT)

    def kill(self) -> None:
        if self._process is not None:
            self._process.kill()
            self._process.wait(timeout=10)
            self._process = None


@pytest.fixture
def redis_url() -> str:
    return REDIS_URL


@pytest.fixture
def key_prefix(redis_url: str) -> Iterator[str]:
    """A fresh key prefix on the shared server; its keys are deleted after the test."""
    prefix = f"tiergate-test-{secrets.token_hex(6)}"
    yield prefix
    client = redis.Redis.from_url(redis_url)
    try:
        keys = list(client.scan_iter(match=f"{prefix}:*", count=1000))
        if keys:
            client.delete(*keys)
    finally:
        client.close()


@pytest.fixture
def throwaway_redis() -> Iterator[ThrowawayRedis]:
    server = ThrowawayRedis()
    server.start()
    try:
        yield server
    finally:
        server.kill()
