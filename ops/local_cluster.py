"""N `tiergate serve` replicas on loopback ports sharing one database and one Redis, and a
round-robin HTTP proxy in front of them: the scale-out of DESIGN.md on one machine, for tests
and demos.

    python -m ops.local_cluster --replicas 3 --proxy-port 8000 \\
        --database-url postgresql+psycopg://postgres@127.0.0.1:5432/test \\
        --redis-url redis://127.0.0.1:6379/0

The database is migrated once before the replicas start, and they run with --no-migrate, as
in Kubernetes (the migration Job); with each_replica_migrates, every replica runs the
migrations itself at start instead, like a plain `tiergate serve`, and they serialise on
PostgreSQL's advisory lock (tests start replicas together on an empty database with it).
Each replica gets its own directory under the work directory for its log (serve.log), its
usage spool (data/) and its copy of the demo model (demo-model/, used when TIERGATE_MODEL is
`demo`), so two replicas never write one file; without TIERGATE_MODEL they serve the default
model, converted once into the shared model cache (the first replica's rename wins).
Database and Redis URLs reach the replicas through the environment, not argv (`ps` shows argv).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import AsyncIterator, Iterator, Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType

import anyio
import httpx
import uvicorn
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.types import Receive, Scope, Send

import migrations
from gateway.http.errors import error_body

__all__ = ["LocalCluster", "LocalClusterError", "RoundRobinProxy", "main"]

READY_PATH = "/health/ready"
# Response header naming the replica that answered (tests check the spread with it).
UPSTREAM_HEADER = "x-tiergate-upstream"
# Headers about one hop rather than the message (RFC 9110, 7.6.1) are never forwarded; host
# is the upstream's own, which httpx sets.
_HOP_BY_HOP = frozenset(
    {
        b"connection",
        b"keep-alive",
        b"proxy-authenticate",
        b"proxy-authorization",
        b"te",
        b"trailer",
        b"transfer-encoding",
        b"upgrade",
        b"host",
    }
)


class LocalClusterError(Exception):
    """A replica did not become ready, or the cluster was used in the wrong state."""


@dataclass
class _Replica:
    port: int  # loopback port it listens on
    process: subprocess.Popen[bytes]  # `tiergate serve`, in its own session
    log_path: Path  # its stdout and stderr together


class LocalCluster:
    """`num_replicas` gateway processes on `host`, ports base_port, base_port + 1, ... (free
    ports when base_port is 0). `env` is added to this process's environment for them.
    each_replica_migrates: no migration before the start; every replica migrates at its own
    start (the replicas of a plain deployment without a migration job)."""

    def __init__(
        self,
        num_replicas: int,
        database_url: str,
        redis_url: str | None,
        env: Mapping[str, str] | None = None,
        base_port: int = 0,
        *,
        host: str = "127.0.0.1",
        work_dir: Path | None = None,
        start_timeout_s: float = 180.0,
        each_replica_migrates: bool = False,
    ) -> None:
        if num_replicas < 1:
            raise ValueError("num_replicas must be >= 1")
        self.num_replicas = num_replicas
        self.database_url = database_url
        # None: every replica keeps its own in-memory rate limits.
        self.redis_url = redis_url
        self.env = dict(env or {})
        self.base_port = base_port
        self.host = host
        # Kept after stop() so logs can be read; a new temporary directory when None.
        self.work_dir = work_dir or Path(tempfile.mkdtemp(prefix="tiergate-cluster-"))
        self.start_timeout_s = start_timeout_s
        self.each_replica_migrates = each_replica_migrates
        self._replicas: list[_Replica] = []

    @property
    def urls(self) -> list[str]:
        """Base URL of each running replica, in start order."""
        return [f"http://{self.host}:{replica.port}" for replica in self._replicas]

    @property
    def log_paths(self) -> list[Path]:
        return [replica.log_path for replica in self._replicas]

    def start(self) -> None:
        """Migrate the database (unless each replica does), start every replica, and return
        once each answers 200 on /health/ready. On failure every replica is stopped and
        LocalClusterError carries the end of the failing replica's log."""
        if self._replicas:
            raise LocalClusterError("the cluster is already started")
        if not self.each_replica_migrates:
            migrations.upgrade_head(self.database_url)
        if self.base_port:
            ports = [self.base_port + index for index in range(self.num_replicas)]
        else:
            ports = _free_ports(self.host, self.num_replicas)
        try:
            for index, port in enumerate(ports):
                self._replicas.append(self._spawn(index, port))
            self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def stop(self, timeout_s: float = 60.0) -> list[int]:
        """SIGTERM every replica (each drains its requests, then exits) and wait for them; a
        replica still running after timeout_s is killed. Returns the exit codes in replica
        order (negative: ended by that signal)."""
        replicas, self._replicas = self._replicas, []
        for replica in replicas:
            if replica.process.poll() is None:
                replica.process.send_signal(signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        codes = []
        for replica in replicas:
            try:
                codes.append(replica.process.wait(max(0.0, deadline - time.monotonic())))
            except subprocess.TimeoutExpired:
                replica.process.kill()
                codes.append(replica.process.wait())
        return codes

    def __enter__(self) -> LocalCluster:
        self.start()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        self.stop()

    def _spawn(self, index: int, port: int) -> _Replica:
        directory = self.work_dir / f"replica-{index}"
        directory.mkdir(parents=True, exist_ok=True)
        env = {**os.environ, **self.env, "TIERGATE_DATABASE_URL": self.database_url}
        env.pop("TIERGATE_REDIS_URL", None)
        if self.redis_url is not None:
            env["TIERGATE_REDIS_URL"] = self.redis_url
        command = [
            sys.executable, "-m", "gateway.cli", "serve",
            "--host", self.host,
            "--port", str(port),
            "--migrate" if self.each_replica_migrates else "--no-migrate",
            "--data-dir", str(directory / "data"),
            "--demo-model-dir", str(directory / "demo-model"),
        ]  # fmt: skip
        log_path = directory / "serve.log"
        with log_path.open("wb") as log:
            # Own session: a Ctrl-C in the terminal reaches this script, which then stops
            # the replicas with SIGTERM (drain), rather than interrupting them all mid-request.
            process = subprocess.Popen(
                command,
                cwd=directory,
                env=env,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=True,
            )
        return _Replica(port, process, log_path)

    def _wait_ready(self) -> None:
        deadline = time.monotonic() + self.start_timeout_s
        pending = list(self._replicas)
        with httpx.Client(timeout=2.0, trust_env=False) as client:
            while pending:
                for replica in list(pending):
                    code = replica.process.poll()
                    if code is not None:
                        raise LocalClusterError(
                            f"replica on port {replica.port} exited with {code} before it was "
                            f"ready; end of {replica.log_path}:\n{_tail(replica.log_path)}"
                        )
                    url = f"http://{self.host}:{replica.port}{READY_PATH}"
                    with contextlib.suppress(httpx.TransportError):
                        if client.get(url).status_code == 200:
                            pending.remove(replica)
                if pending and time.monotonic() > deadline:
                    replica = pending[0]
                    raise LocalClusterError(
                        f"replica on port {replica.port} not ready after "
                        f"{self.start_timeout_s:.0f} s; end of {replica.log_path}:\n"
                        f"{_tail(replica.log_path)}"
                    )
                if pending:
                    time.sleep(0.2)


class RoundRobinProxy:
    """An HTTP reverse proxy on asyncio. Each request goes to the next upstream in turn; a
    refused connection moves on to the following one (the request had not been sent); no
    upstream accepting is a 502 with an OpenAI error body. Response bodies, SSE token streams
    included, are relayed chunk by chunk as they arrive, and a client that goes away closes
    its upstream connection, so the replica sees the disconnect and aborts the request."""

    def __init__(
        self,
        upstream_urls: Sequence[str],
        host: str = "127.0.0.1",
        port: int = 0,
        *,
        read_timeout_s: float = 600.0,
    ) -> None:
        if not upstream_urls:
            raise ValueError("RoundRobinProxy needs at least one upstream")
        self._upstream_urls = [url.rstrip("/") for url in upstream_urls]
        self._turns = itertools.cycle(range(len(self._upstream_urls)))
        self._host = host
        self._port = port
        # Longest silence allowed between two chunks of an upstream response.
        self._read_timeout_s = read_timeout_s
        self._socket: socket.socket | None = None
        self._client: httpx.AsyncClient | None = None
        self._server: _EmbeddedServer | None = None
        self._task: asyncio.Task[None] | None = None

    @property
    def url(self) -> str:
        if self._socket is None:
            raise LocalClusterError("the proxy is not started")
        host, port = self._socket.getsockname()[:2]
        return f"http://{host}:{port}"

    async def start(self) -> None:
        """Bind and serve in a task of the running loop; returns once it accepts connections."""
        if self._task is not None:
            raise LocalClusterError("the proxy is already started")
        self._socket = socket.create_server((self._host, self._port))
        self._client = httpx.AsyncClient(
            timeout=httpx.Timeout(connect=5.0, read=self._read_timeout_s, write=30.0, pool=None),
            limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
            trust_env=False,
        )
        # log_config=None: leave the process's logging configuration alone. No server or
        # date header of its own: the upstream's are relayed. x-forwarded-* are not trusted.
        config = uvicorn.Config(
            self._asgi, interface="asgi3", lifespan="off", log_config=None, access_log=False,
            server_header=False, date_header=False, proxy_headers=False,
            timeout_graceful_shutdown=5,
        )  # fmt: skip
        self._server = _EmbeddedServer(config)
        self._task = asyncio.create_task(self._server.serve(sockets=[self._socket]))
        while not self._server.started:
            if self._task.done():
                await self._task  # raises what stopped it
                raise LocalClusterError("the proxy stopped while starting")
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is not None and self._task is not None:
            self._server.should_exit = True
            await self._task
        if self._client is not None:
            await self._client.aclose()
        if self._socket is not None:
            self._socket.close()
        self._server, self._task, self._client, self._socket = None, None, None, None

    async def __aenter__(self) -> RoundRobinProxy:
        await self.start()
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        traceback: TracebackType | None,
    ) -> None:
        await self.stop()

    async def _asgi(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":  # lifespan is off; websockets are not proxied
            return
        response = await self._forward(Request(scope, receive))
        await response(scope, receive, send)

    async def _forward(self, request: Request) -> Response:
        assert self._client is not None
        # Read whole (requests to the gateway are small) so a refused upstream can be retried.
        body = await request.body()
        headers = [(k, v) for k, v in request.headers.raw if k.lower() not in _HOP_BY_HOP]
        target = request.url.path + (f"?{request.url.query}" if request.url.query else "")
        for _ in self._upstream_urls:
            upstream = self._upstream_urls[next(self._turns)]
            outgoing = self._client.build_request(
                request.method, upstream + target, headers=headers, content=body or None
            )
            try:
                answer = await self._client.send(outgoing, stream=True)
            except (httpx.ConnectError, httpx.ConnectTimeout):
                continue
            except httpx.TransportError as exc:
                return _bad_gateway(f"replica {upstream} failed: {exc}")
            relayed = StreamingResponse(_relay(answer), status_code=answer.status_code)
            # Set raw: repeated headers (set-cookie) survive, and content-type is not invented.
            relayed.raw_headers = [
                (k.lower(), v) for k, v in answer.headers.raw if k.lower() not in _HOP_BY_HOP
            ] + [(UPSTREAM_HEADER.encode(), upstream.encode())]
            return relayed
        return _bad_gateway("no replica accepted the connection")


class _EmbeddedServer(uvicorn.Server):
    """uvicorn without its own SIGINT/SIGTERM handlers: whoever runs the proxy owns them."""

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def _relay(answer: httpx.Response) -> AsyncIterator[bytes]:
    try:
        async for chunk in answer.aiter_raw():
            yield chunk
    finally:
        # Also runs when the client went away: Starlette cancels the stream, or the generator
        # is closed at its yield. Shielded, so the upstream connection is closed and leaves the
        # pool even inside a cancelled scope, and the replica sees the disconnect.
        with anyio.CancelScope(shield=True):
            await answer.aclose()


def _bad_gateway(message: str) -> JSONResponse:
    return JSONResponse(
        error_body(message, "upstream_error", code="upstream_unavailable"), status_code=502
    )


def _free_ports(host: str, num_ports: int) -> list[int]:
    # Held open together so the kernel hands out distinct ports; a port can still be taken
    # between here and the replica's bind, which then fails fast with its log in the error.
    sockets = [socket.create_server((host, 0)) for _ in range(num_ports)]
    try:
        return [sock.getsockname()[1] for sock in sockets]
    finally:
        for sock in sockets:
            sock.close()


def _tail(path: Path, num_lines: int = 40) -> str:
    try:
        lines = path.read_text(errors="replace").splitlines()
    except OSError as exc:
        return f"(cannot read the log: {exc})"
    return "\n".join(lines[-num_lines:])


async def _run_until_signal(urls: Sequence[str], host: str, proxy_port: int | None) -> None:
    stopping = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stopping.set)
    if proxy_port is None:
        print("no proxy: clients spread requests over the replicas; Ctrl-C stops them")
        await stopping.wait()
        return
    async with RoundRobinProxy(urls, host, proxy_port) as proxy:
        print(f"proxy {proxy.url} -> {len(urls)} replicas, round robin; Ctrl-C stops")
        await stopping.wait()


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m ops.local_cluster",
        description="Start N tiergate serve replicas on loopback ports sharing one database "
        "and one Redis, optionally behind a round-robin proxy; Ctrl-C drains and stops them.",
    )
    parser.add_argument("--replicas", type=int, default=2, help="number of replicas (2)")
    parser.add_argument(
        "--database-url",
        default=os.environ.get("TIERGATE_DATABASE_URL"),
        required="TIERGATE_DATABASE_URL" not in os.environ,
        help="shared database, migrated once (env TIERGATE_DATABASE_URL)",
    )
    parser.add_argument(
        "--redis-url",
        default=os.environ.get("TIERGATE_REDIS_URL", "redis://127.0.0.1:6379/0"),
        help="shared Redis for rate limits (env TIERGATE_REDIS_URL, default the local one)",
    )
    parser.add_argument("--host", default="127.0.0.1", help="address of replicas and proxy")
    parser.add_argument(
        "--base-port", type=int, default=0, help="first replica port (default: free ports)"
    )
    parser.add_argument(
        "--proxy-port", type=int, default=None, help="run the proxy on this port (0: any)"
    )
    parser.add_argument(
        "--work-dir", type=Path, default=None, help="replica logs, spools (default: a temp dir)"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    cluster = LocalCluster(
        args.replicas,
        args.database_url,
        args.redis_url,
        base_port=args.base_port,
        host=args.host,
        work_dir=args.work_dir,
    )
    cluster.start()
    try:
        for url, log_path in zip(cluster.urls, cluster.log_paths, strict=True):
            print(f"replica {url} (log {log_path})")
        asyncio.run(_run_until_signal(cluster.urls, args.host, args.proxy_port))
    finally:
        codes = cluster.stop()
    print(f"replicas exited with {codes}")
    return 0 if all(code == 0 for code in codes) else 1


if __name__ == "__main__":
    sys.exit(main())
