"""ops.local_cluster: the round-robin proxy against small HTTP servers on loopback sockets, and
the cluster itself starting real `tiergate serve` replicas on a shared PostgreSQL and Redis."""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
import socket
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from types import TracebackType

import httpx
import pytest

from engine.checkpoints.demo_model import write_demo_model
from ops.local_cluster import UPSTREAM_HEADER, LocalCluster, LocalClusterError, RoundRobinProxy
from tests.tenants.conftest import scratch_database


@dataclass
class Received:
    """One request as an upstream saw it."""

    method: str
    target: str  # path and query
    headers: dict[str, str]  # lower-cased names
    body: bytes


Handler = Callable[
    ["Upstream", Received, asyncio.StreamReader, asyncio.StreamWriter], Awaitable[None]
]


async def answer_json(
    upstream: Upstream, received: Received, _r: asyncio.StreamReader, writer: asyncio.StreamWriter
) -> None:
    body = json.dumps({"upstream": upstream.name, "target": received.target}).encode()
    writer.write(
        b"HTTP/1.1 200 OK\r\ncontent-type: application/json\r\nconnection: close\r\n"
        + f"content-length: {len(body)}\r\n\r\n".encode()
        + body
    )
    await writer.drain()


@dataclass
class Upstream:
    """A loopback HTTP/1.1 server on asyncio streams: parses one request per connection, records
    it, and lets `handler` write the response."""

    name: str
    handler: Handler = answer_json
    received: list[Received] = field(default_factory=list)
    _server: asyncio.Server | None = None

    @property
    def url(self) -> str:
        assert self._server is not None
        return f"http://127.0.0.1:{self._server.sockets[0].getsockname()[1]}"

    async def __aenter__(self) -> Upstream:
        self._server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self

    async def __aexit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        assert self._server is not None
        self._server.close()
        await self._server.wait_closed()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        try:
            head = (await reader.readuntil(b"\r\n\r\n")).decode("latin-1").split("\r\n")
            method, target, _version = head[0].split(" ")
            headers = {}
            for line in head[1:]:
                if line:
                    name, value = line.split(":", 1)
                    headers[name.strip().lower()] = value.strip()
            body = await reader.readexactly(int(headers.get("content-length", "0")))
            received = Received(method, target, headers, body)
            self.received.append(received)
            await self.handler(self, received, reader, writer)
        finally:
            writer.close()
            with contextlib.suppress(ConnectionError):
                await writer.wait_closed()


def closed_port() -> int:
    """A loopback port nothing listens on."""
    with socket.create_server(("127.0.0.1", 0)) as sock:
        return int(sock.getsockname()[1])


def client() -> httpx.AsyncClient:
    return httpx.AsyncClient(timeout=10.0, trust_env=False)


def test_requests_go_to_the_upstreams_in_turn_with_method_path_body_and_headers() -> None:
    async def scenario() -> None:
        async with Upstream("a") as a, Upstream("b") as b, Upstream("c") as c:
            async with RoundRobinProxy([a.url, b.url, c.url]) as proxy, client() as http:
                answers = [
                    await http.post(
                        f"{proxy.url}/v1/chat/completions?trace=1",
                        content=f'{{"n": {n}}}'.encode(),
                        headers={"authorization": "Bearer tg-key", "content-type": "text/json"},
                    )
                    for n in range(6)
                ]
            assert [r.json()["upstream"] for r in answers] == ["a", "b", "c", "a", "b", "c"]
            assert [r.headers[UPSTREAM_HEADER] for r in answers[:3]] == [a.url, b.url, c.url]
            for upstream, numbers in ((a, [0, 3]), (b, [1, 4]), (c, [2, 5])):
                expected = [f'{{"n": {n}}}'.encode() for n in numbers]
                assert [r.body for r in upstream.received] == expected
                for received in upstream.received:
                    assert received.method == "POST"
                    assert received.target == "/v1/chat/completions?trace=1"
                    assert received.headers["authorization"] == "Bearer tg-key"
                    assert received.headers["content-type"] == "text/json"
                    # The upstream's own host, not the proxy's.
                    assert received.headers["host"] == upstream.url.removeprefix("http://")

    asyncio.run(scenario())


def test_status_and_repeated_headers_come_back_unchanged() -> None:
    async def limited(
        _u: Upstream, _r: Received, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        body = b'{"error": {"code": "rate_limit_exceeded"}}'
        writer.write(
            b"HTTP/1.1 429 Too Many Requests\r\ncontent-type: application/json\r\n"
            b"retry-after: 3\r\nset-cookie: a=1\r\nset-cookie: b=2\r\nconnection: close\r\n"
            + f"content-length: {len(body)}\r\n\r\n".encode()
            + body
        )
        await writer.drain()

    async def scenario() -> None:
        async with (
            Upstream("limited", limited) as upstream,
            RoundRobinProxy([upstream.url]) as proxy,
            client() as http,
        ):
            answer = await http.get(f"{proxy.url}/v1/models")
        assert answer.status_code == 429
        assert answer.headers["retry-after"] == "3"
        assert answer.headers.get_list("set-cookie") == ["a=1", "b=2"]
        assert answer.json() == {"error": {"code": "rate_limit_exceeded"}}

    asyncio.run(scenario())


def test_a_streamed_response_is_relayed_chunk_by_chunk() -> None:
    # The upstream sends its second event only after the client has received the first one
    # through the proxy: a proxy that buffered the body would time out here.
    first_seen = asyncio.Event()

    async def stream(
        _u: Upstream, _r: Received, _reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\nconnection: close\r\n\r\n"
        )
        for event in (b"data: one\n\n", b"data: two\n\n"):
            writer.write(b"%x\r\n%s\r\n" % (len(event), event))
            await writer.drain()
            await asyncio.wait_for(first_seen.wait(), 30.0)
        writer.write(b"0\r\n\r\n")
        await writer.drain()

    async def scenario() -> None:
        async with (
            Upstream("stream", stream) as upstream,
            RoundRobinProxy([upstream.url]) as proxy,
            client() as http,
            http.stream("POST", f"{proxy.url}/v1/completions") as answer,
        ):
            assert answer.headers["content-type"] == "text/event-stream"
            chunks = answer.aiter_raw()
            received = b""
            while received != b"data: one\n\n":
                received += await asyncio.wait_for(anext(chunks), 10.0)
            first_seen.set()
            async for chunk in chunks:
                received += chunk
        assert received == b"data: one\n\ndata: two\n\n"

    asyncio.run(scenario())


def test_a_client_that_goes_away_closes_the_upstream_connection() -> None:
    upstream_saw_close = asyncio.Event()

    async def endless(
        _u: Upstream, _r: Received, reader: asyncio.StreamReader, writer: asyncio.StreamWriter
    ) -> None:
        writer.write(
            b"HTTP/1.1 200 OK\r\ncontent-type: text/event-stream\r\n"
            b"transfer-encoding: chunked\r\n\r\n" + b"c\r\ndata: tick\n\n\r\n"
        )
        await writer.drain()
        # The proxy never sends more on this connection: EOF means it closed it.
        if await asyncio.wait_for(reader.read(1), 30.0) == b"":
            upstream_saw_close.set()

    async def scenario() -> None:
        async with (
            Upstream("endless", endless) as upstream,
            RoundRobinProxy([upstream.url]) as proxy,
            client() as http,
        ):
            async with http.stream("GET", f"{proxy.url}/v1/completions") as answer:
                first = await asyncio.wait_for(anext(answer.aiter_raw()), 10.0)
                assert first == b"data: tick\n\n"
            # Leaving the block mid-body closes the client's connection.
            await asyncio.wait_for(upstream_saw_close.wait(), 20.0)

    asyncio.run(scenario())


def test_a_refused_upstream_is_skipped_and_none_left_is_a_502() -> None:
    async def scenario() -> None:
        async with Upstream("live") as live:
            dead = f"http://127.0.0.1:{closed_port()}"
            async with RoundRobinProxy([dead, live.url]) as proxy, client() as http:
                answers = [await http.get(f"{proxy.url}/health/ready") for _ in range(4)]
            assert [r.status_code for r in answers] == [200] * 4
            assert {r.json()["upstream"] for r in answers} == {"live"}
            assert len(live.received) == 4
        dead_too = f"http://127.0.0.1:{closed_port()}"
        async with RoundRobinProxy([dead, dead_too]) as proxy, client() as http:
            answer = await http.get(f"{proxy.url}/v1/models")
        assert answer.status_code == 502
        assert answer.json()["error"]["code"] == "upstream_unavailable"
        assert set(answer.json()["error"]) == {"message", "type", "param", "code"}

    asyncio.run(scenario())


def test_a_replica_that_exits_before_it_is_ready_is_an_error_with_its_log(
    tmp_path: Path,
) -> None:
    cluster = LocalCluster(
        1,
        f"sqlite:///{tmp_path / 'tiergate.db'}",
        None,
        env={"TIERGATE_DEVICE": "tpu"},
        work_dir=tmp_path / "cluster",
        start_timeout_s=60.0,
    )
    with pytest.raises(LocalClusterError, match="exited with") as failure:
        cluster.start()
    log = (tmp_path / "cluster" / "replica-0" / "serve.log").read_text()
    assert "--device" in log
    assert log.strip() in str(failure.value)  # the error carries the end of the log
    assert cluster.urls == []


@pytest.fixture(scope="module")
def demo_model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo-model"))


@pytest.fixture
def postgres_url(tmp_path: Path) -> Iterator[str]:
    with scratch_database("postgresql", tmp_path) as url:
        yield url


def test_two_replicas_share_postgresql_and_redis_answer_ready_and_drain_on_stop(
    tmp_path: Path, demo_model_dir: Path, postgres_url: str
) -> None:
    env = {
        "TIERGATE_MODEL": str(demo_model_dir),
        "TIERGATE_DEVICE": "cpu",
        "TIERGATE_ADMIN_TOKEN": secrets.token_hex(16),
    }
    cluster = LocalCluster(
        2, postgres_url, "redis://127.0.0.1:6379/0", env, work_dir=tmp_path / "cluster"
    )
    cluster.start()
    try:
        assert len(set(cluster.urls)) == 2
        for url in cluster.urls:
            assert httpx.get(f"{url}/health/ready", trust_env=False).status_code == 200

        async def through_proxy() -> list[str]:
            async with RoundRobinProxy(cluster.urls) as proxy, client() as http:
                answers = [await http.get(f"{proxy.url}/health/ready") for _ in range(4)]
            assert [r.status_code for r in answers] == [200] * 4
            return [r.headers[UPSTREAM_HEADER] for r in answers]

        assert asyncio.run(through_proxy()) == cluster.urls * 2
    finally:
        codes = cluster.stop()
    assert codes == [0, 0]  # SIGTERM drains, then exits 0
