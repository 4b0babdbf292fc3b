"""Nothing a client was told succeeded is unrecorded: with the database away and the spool
unwritable, a finished request's client gets an error (503 usage_not_recorded, or an error
event instead of a stream's end), never its result; once the ledger can write again,
requests succeed and are recorded. A client that goes away while its request is being
finalized does not skip the record.

The replica runs in this process (tests/gateway/app_harness.py) over SQLite, made unavailable
as a running replica sees it (another process holds its write lock), with its spool's folder
replaced by a file; the client is the openai SDK.
"""

from __future__ import annotations

import asyncio
import json
import shutil
import threading
import time
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletionChunk
from prometheus_client.parser import text_string_to_metric_families
from sqlalchemy import select
from starlette.types import ASGIApp, Receive, Scope, Send

from billing import UsageRecordRow
from gateway.server.billing_wiring import LedgerSink
from gateway.server.model_source import DEMO_MODEL_NAME
from tests.gateway.app_harness import InProcessGateway, start_gateway
from tests.gateway.server.test_serve_outage import SqliteWriteLock


def _stored_ids(gateway: InProcessGateway) -> set[str]:
    with gateway.runtime.session_factory() as session:
        return set(session.scalars(select(UsageRecordRow.request_id)))


def _chat(client: openai.OpenAI) -> openai.types.chat.ChatCompletion:
    return client.chat.completions.create(
        model=DEMO_MODEL_NAME, messages=[{"role": "user", "content": "hello"}], max_tokens=4
    )


def test_a_request_whose_record_cannot_be_written_is_an_error(tmp_path: Path) -> None:
    work = tmp_path / "replica"
    work.mkdir()
    gateway = start_gateway(work)
    lock = SqliteWriteLock(f"sqlite:///{work / 'tiergate.db'}")
    data = work / "data"
    try:
        _, key = gateway.create_tenant("acme", "standard")
        client = gateway.openai_client(key)
        before = _chat(client)
        # Database away, and the spool's folder a file: no record can be made durable.
        lock.stop()
        shutil.move(data, work / "data-away")
        data.write_text("not a folder")
        try:
            with pytest.raises(openai.APIStatusError) as plain:
                _chat(client)
            received: list[ChatCompletionChunk] = []
            # An error event where the last chunk and [DONE] would be.
            with pytest.raises(openai.APIError) as streamed, client.chat.completions.create(
                model=DEMO_MODEL_NAME, messages=[{"role": "user", "content": "hi"}],
                max_tokens=4, stream=True,
            ) as stream:
                received.extend(stream)
        finally:
            data.unlink()
            shutil.move(work / "data-away", data)
            lock.resume()
        after = _chat(client)
        metrics = httpx.get(f"{gateway.base_url}/metrics", timeout=30).text
    finally:
        gateway.stop()
    assert plain.value.status_code == 503
    assert plain.value.code == "usage_not_recorded"
    assert "could not be recorded" in streamed.value.message
    assert not any(c.finish_reason for chunk in received for c in chunk.choices)
    stored = _stored_ids(gateway)
    assert {before.id, after.id} <= stored
    # The two refused a result have no record, and nothing else was written meanwhile.
    assert len(stored) == 2
    # The metrics count them as what the clients got: failed, 503.
    counted = {
        (sample.labels["status"], sample.labels["code"]): sample.value
        for family in text_string_to_metric_families(metrics)
        for sample in family.samples
        if sample.name == "tiergate_requests_total"
    }
    assert counted[("failed", "503")] == 2
    assert counted[("completed", "200")] == 2


def _asgi_2_3(app: ASGIApp) -> ASGIApp:
    """The app as a server of ASGI 2.3 (Hypercorn, Daphne) runs it: Starlette then cancels a
    stream as soon as its client disconnects (under 2.4, as uvicorn speaks, it finds out at
    the next write)."""

    async def served(scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http":
            scope = {**scope, "asgi": {**scope.get("asgi", {}), "spec_version": "2.3"}}
        await app(scope, receive, send)

    return served


def test_a_client_gone_while_its_request_is_finalized_still_leaves_a_record(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The stream's end waits for the record; a disconnect then cancels the response (on an
    ASGI 2.3 server), which must not cancel the record."""
    record = LedgerSink.record
    recording = threading.Event()

    async def slow_record(self: LedgerSink, *args: Any) -> None:
        recording.set()
        await asyncio.sleep(1.0)  # as a slow commit would
        await record(self, *args)

    monkeypatch.setattr(LedgerSink, "record", slow_record)
    gateway = start_gateway(tmp_path, wrap_app=_asgi_2_3)
    try:
        _, key = gateway.create_tenant("acme", "standard")
        body = {"model": DEMO_MODEL_NAME, "max_tokens": 4, "stream": True,
                "messages": [{"role": "user", "content": "hello"}]}
        with httpx.Client(base_url=gateway.base_url, timeout=30) as client, client.stream(
            "POST", "/v1/chat/completions", json=body,
            headers={"authorization": f"Bearer {key}"},
        ) as response:
            lines = response.iter_lines()  # dropping it would close the connection now
            first = next(lines)
            assert recording.wait(10)
        # The connection is closed here, while the record is being written.
        response_id = json.loads(first.removeprefix("data: "))["id"]
        deadline = time.monotonic() + 10
        while response_id not in _stored_ids(gateway):
            assert time.monotonic() < deadline, "no record"
            time.sleep(0.05)
    finally:
        gateway.stop()
