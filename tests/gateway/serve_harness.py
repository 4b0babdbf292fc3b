"""Clients of a real `tiergate serve` for the server-level billing tests, and the detail
export to hold what they saw against. No tests of its own: server/test_serve_crash.py,
test_serve_outage.py, test_serve_conservation.py and test_serve_budgets.py share it.

Traffic is seeded: each client draws chat or completions, streamed or not, n = 1 or 2, and
(if asked) leaves some streams after their first chunk. Every request remembers what its
client saw: the response id, the usage, and whether the end ([DONE], or the whole body)
arrived. Only a request whose client saw its end is owed a record with exactly that usage.
"""

from __future__ import annotations

import asyncio
import json
import random
import subprocess
import sys
import time
from collections import Counter
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import httpx
from prometheus_client.parser import text_string_to_metric_families

from tests.serve_process import ADMIN_TOKEN, ServeProcess

MODEL = "tiergate-demo"
_WORDS = ("ledger", "tenant", "spool", "token", "river", "quiet", "engine", "budget", "seven")


@dataclass(frozen=True)
class TrafficMix:
    """How each client picks its next request."""

    stream_fraction: float = 0.5  # streamed (with usage in the last chunk)
    chat_fraction: float = 0.5  # chat completions; the rest are completions
    multi_sample_fraction: float = 0.25  # n = 2 instead of 1
    abandon_fraction: float = 0.0  # streams the client leaves after the first chunk
    min_max_tokens: int = 4
    max_max_tokens: int = 40


@dataclass
class ClientRequest:
    """One request as its client saw it."""

    endpoint: str  # "chat/completions" or "completions"
    is_stream: bool
    n: int  # samples asked for
    is_abandoned: bool  # the client meant to leave after the first chunk
    status_code: int | None = None  # None: no HTTP response (the connection failed)
    response_id: str | None = None  # chatcmpl-... / cmpl-..., as the client received it
    num_prompt_tokens: int | None = None  # the usage the client received
    num_completion_tokens: int | None = None
    is_complete: bool = False  # the client received [DONE], or the whole non-stream body
    error: str | None = None  # transport error or error body, when there was one
    # The class of the transport error (ConnectError: never reached the server), if any.
    transport_error: str | None = None
    sent_at_s: float = 0.0  # time.monotonic() when the client sent it
    latency_s: float | None = None  # sent to the last byte read; None until it ended


class Traffic:
    """num_clients clients, each sending one request after another until stopped."""

    def __init__(
        self,
        base_url: str,
        api_key: str,
        *,
        num_clients: int,
        seed: int,
        mix: TrafficMix | None = None,
    ) -> None:
        self.base_url = base_url
        self.api_key = api_key
        self.num_clients = num_clients
        self.seed = seed
        self.mix = mix or TrafficMix()
        self.requests: list[ClientRequest] = []

    @property
    def completed(self) -> list[ClientRequest]:
        return [r for r in self.requests if r.is_complete]

    @property
    def cut_off(self) -> list[ClientRequest]:
        """Requests the server had received when the connection broke."""
        return [r for r in self.requests if r.transport_error not in (None, "ConnectError")]

    async def run(self, stop: asyncio.Event) -> None:
        """Send requests until stop is set (or the server is gone), then return."""
        # No keep-alive: a stream left early must close its connection, as a client's would.
        limits = httpx.Limits(max_connections=self.num_clients, max_keepalive_connections=0)
        async with httpx.AsyncClient(
            base_url=self.base_url,
            headers={"authorization": f"Bearer {self.api_key}"},
            timeout=httpx.Timeout(120.0, connect=5.0),
            limits=limits,
        ) as client:
            await asyncio.gather(
                *(self._client(client, index, stop) for index in range(self.num_clients))
            )

    async def _client(self, client: httpx.AsyncClient, index: int, stop: asyncio.Event) -> None:
        rng = random.Random(self.seed * 1_000 + index)
        while not stop.is_set():
            request, body = self._draw(rng)
            self.requests.append(request)
            request.sent_at_s = time.monotonic()
            try:
                if request.is_stream:
                    await _stream(client, request, body)
                else:
                    await _post(client, request, body)
            except httpx.TransportError as exc:
                request.transport_error = type(exc).__name__
                request.error = f"{request.transport_error}: {exc}"
                if isinstance(exc, httpx.ConnectError):
                    return  # the server is gone
            finally:
                request.latency_s = time.monotonic() - request.sent_at_s

    def _draw(self, rng: random.Random) -> tuple[ClientRequest, dict[str, Any]]:
        mix = self.mix
        is_chat = rng.random() < mix.chat_fraction
        is_stream = rng.random() < mix.stream_fraction
        n = 2 if rng.random() < mix.multi_sample_fraction else 1
        text = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(2, 12)))
        body: dict[str, Any] = {
            "model": MODEL,
            "max_tokens": rng.randint(mix.min_max_tokens, mix.max_max_tokens),
            "n": n,
            "ignore_eos": rng.random() < 0.5,
            "seed": rng.randrange(1 << 30),
        }
        if is_chat:
            body["messages"] = [{"role": "user", "content": text}]
        else:
            body["prompt"] = text
        if is_stream:
            body["stream"] = True
            body["stream_options"] = {"include_usage": True}
        request = ClientRequest(
            endpoint="chat/completions" if is_chat else "completions",
            is_stream=is_stream,
            n=n,
            is_abandoned=is_stream and rng.random() < mix.abandon_fraction,
        )
        return request, body


async def _post(client: httpx.AsyncClient, request: ClientRequest, body: dict[str, Any]) -> None:
    response = await client.post(f"/v1/{request.endpoint}", json=body)
    request.status_code = response.status_code
    data = response.json()
    if response.status_code != 200:
        request.error = json.dumps(data.get("error"))
        return
    request.response_id = data["id"]
    request.num_prompt_tokens = data["usage"]["prompt_tokens"]
    request.num_completion_tokens = data["usage"]["completion_tokens"]
    request.is_complete = True


async def _stream(client: httpx.AsyncClient, request: ClientRequest, body: dict[str, Any]) -> None:
    async with client.stream("POST", f"/v1/{request.endpoint}", json=body) as response:
        request.status_code = response.status_code
        if response.status_code != 200:
            request.error = (await response.aread()).decode(errors="replace")
            return
        async for line in response.aiter_lines():
            if line == "data: [DONE]":
                request.is_complete = request.error is None
                return
            if not line.startswith("data: "):
                continue
            chunk = json.loads(line[len("data: ") :])
            if "error" in chunk:
                request.error = json.dumps(chunk["error"])
                continue
            request.response_id = chunk["id"]
            if chunk.get("usage"):
                request.num_prompt_tokens = chunk["usage"]["prompt_tokens"]
                request.num_completion_tokens = chunk["usage"]["completion_tokens"]
            if request.is_abandoned:
                return  # leaving the block closes the connection mid-stream


async def run_for(traffic: Traffic, duration_s: float) -> None:
    """Run traffic for duration_s, then let every request in flight finish."""
    stop = asyncio.Event()
    task = asyncio.create_task(traffic.run(stop))
    await asyncio.sleep(duration_s)
    stop.set()
    await task


# --- the server's side ----------------------------------------------------------------------------


def start_replica(database_url: str, data_dir: Path) -> ServeProcess:
    """A started `tiergate serve` on database_url whose data (the usage spool) is in data_dir,
    so that a replica started again on the same folder replays what the last one left."""
    return ServeProcess(database_url, env={"TIERGATE_DATA_DIR": str(data_dir)}).start()


def admin_client(server: ServeProcess) -> httpx.Client:
    return httpx.Client(
        base_url=server.base_url, headers={"x-admin-token": ADMIN_TOKEN}, timeout=60.0
    )


def billing_periods(since: datetime) -> list[str]:
    """The months (YYYY-MM, UTC) from since to now: a test may straddle a month's end."""
    now = datetime.now(UTC)
    periods = []
    year, month = since.year, since.month
    while (year, month) <= (now.year, now.month):
        periods.append(f"{year:04d}-{month:02d}")
        year, month = (year + 1, 1) if month == 12 else (year, month + 1)
    return periods


def detail_export(server: ServeProcess, periods: Sequence[str]) -> list[dict[str, Any]]:
    """Every usage record of periods, from GET /admin/v1/billing/export?detail=true."""
    records: list[dict[str, Any]] = []
    with admin_client(server) as admin:
        for period in periods:
            response = admin.get(
                "/admin/v1/billing/export",
                params={"period": period, "format": "jsonl", "detail": "true"},
            )
            assert response.status_code == 200, response.text
            records += _jsonl(response.text)
    return records


def cli_detail_export(database_url: str, periods: Sequence[str]) -> list[dict[str, Any]]:
    """Every usage record of periods, from `tiergate billing export --detail`."""
    records: list[dict[str, Any]] = []
    for period in periods:
        result = subprocess.run(
            [
                sys.executable, "-m", "gateway.cli", "billing", "export", "--period", period,
                "--detail", "--format", "jsonl", "--database-url", database_url, "--no-migrate",
            ],
            capture_output=True, text=True, timeout=120, check=False,
        )  # fmt: skip
        assert result.returncode == 0, result.stderr
        records += _jsonl(result.stdout)
    return records


def _jsonl(text: str) -> Iterator[dict[str, Any]]:
    return (json.loads(line) for line in text.splitlines() if line)


@dataclass(frozen=True)
class BillingCheck:
    """How the export compares with what the clients saw (after the asserts passed)."""

    num_sent: int  # requests the clients sent
    num_complete: int  # of those, seen to the end: each has exactly one matching record
    num_unfinished_billed: int  # not seen to the end, and billed (once) anyway
    num_records: int  # records in the export
    statuses: dict[str, int] = field(default_factory=dict)  # records by status


def assert_billed_exactly_once(
    requests: Sequence[ClientRequest], records: Sequence[dict[str, Any]]
) -> BillingCheck:
    """Every request whose client saw its end has exactly one record, with the usage the
    client received; no request id is billed twice; nothing is billed that was not sent."""
    num_records_by_id = Counter(record["request_id"] for record in records)
    twice = [request_id for request_id, count in num_records_by_id.items() if count > 1]
    assert not twice, f"billed more than once: {twice}"
    by_id = {record["request_id"]: record for record in records}
    for request in requests:
        if not request.is_complete:
            continue
        record = by_id.get(str(request.response_id))
        assert record is not None, f"{request} finished for its client but is not billed"
        assert record["status"] == "completed", (request, record)
        assert (record["num_prompt_tokens"], record["num_completion_tokens"]) == (
            request.num_prompt_tokens, request.num_completion_tokens
        ), (request, record)  # fmt: skip
    assert len(records) <= len(requests)
    return BillingCheck(
        num_sent=len(requests),
        num_complete=sum(r.is_complete for r in requests),
        num_unfinished_billed=sum(not r.is_complete and r.response_id in by_id for r in requests),
        num_records=len(records),
        statuses=dict(Counter(record["status"] for record in records)),
    )


def metric_value(server: ServeProcess, name: str) -> float:
    """A series' value summed over its labels (e.g. an engine counter's ``_total`` over the
    served models) from GET /metrics."""
    text = httpx.get(f"{server.base_url}/metrics", timeout=30.0).text
    values = [float(sample.value) for family in text_string_to_metric_families(text)
              for sample in family.samples if sample.name == name]
    assert values, f"{name} is not in /metrics"
    return sum(values)
