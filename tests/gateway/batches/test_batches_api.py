"""The Batches API on a real `tiergate serve` (demo model, SQLite) with the official openai
SDK: files.create, batches.create, poll, files.content; a line the server refuses goes to the
error file and the batch completes; cancel; expiry; a budget reached mid-batch; another
tenant's batch is a 404; the ledger holds one record per line, in the batch tier."""

from __future__ import annotations

import io
import json
import sqlite3
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest
from openai.types import Batch

from tests.serve_process import ADMIN_TOKEN, ServeProcess

MODEL = "tiergate-demo"


def chat_line(custom_id: str, content: str, **body: Any) -> dict[str, Any]:
    return {"custom_id": custom_id, "method": "POST", "url": "/v1/chat/completions",
            "body": {"model": MODEL, "max_tokens": 4,
                     "messages": [{"role": "user", "content": content}], **body}}


def jsonl(lines: list[dict[str, Any]]) -> io.BytesIO:
    return io.BytesIO(b"".join(json.dumps(line).encode() + b"\n" for line in lines))


def wait_for(client: openai.OpenAI, batch_id: str, statuses: tuple[str, ...],
             timeout_s: float = 120.0) -> Batch:
    deadline = time.monotonic() + timeout_s
    while True:
        batch = client.batches.retrieve(batch_id)
        if batch.status in statuses:
            return batch
        assert time.monotonic() < deadline, batch
        time.sleep(0.2)


def results(client: openai.OpenAI, file_id: str | None) -> list[dict[str, Any]]:
    if file_id is None:
        return []
    return [json.loads(line) for line in client.files.content(file_id).read().splitlines()]


@pytest.fixture(scope="module")
def database(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("batches") / "db"


@pytest.fixture(scope="module")
def server(database: Path) -> Iterator[ServeProcess]:
    with ServeProcess(f"sqlite:///{database}", args=["--batch-max-in-flight", "4"]
                      ).start() as process:
        yield process


@pytest.fixture(scope="module")
def admin(server: ServeProcess) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base_url, headers={"x-admin-token": ADMIN_TOKEN}) as client:
        yield client


def new_client(server: ServeProcess, admin: httpx.Client, name: str,
               quota: dict[str, Any] | None = None) -> openai.OpenAI:
    tenant = admin.post("/admin/v1/tenants",
                        json={"name": name, "tier": "standard", "quota": quota or {}})
    assert tenant.status_code == 201, tenant.text
    key = admin.post(f"/admin/v1/tenants/{tenant.json()['id']}/keys", json={"name": "k"})
    assert key.status_code == 201, key.text
    return openai.OpenAI(base_url=f"{server.base_url}/v1", api_key=key.json()["key"],
                         max_retries=0)


def test_a_batch_runs_every_line_once_and_bills_each_in_the_batch_tier(
    server: ServeProcess, admin: httpx.Client, database: Path,
) -> None:
    client = new_client(server, admin, "runs")
    lines = [chat_line(f"line-{i}", f"Say {i % 3}") for i in range(12)]
    lines.append(chat_line("bad-model", "hi", model="no-such-model"))
    lines.append(chat_line("bad-param", "hi", max_tokens=-1))
    file = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    created = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                    completion_window="24h", metadata={"job": "nightly"})
    assert created.status == "in_progress" and created.metadata == {"job": "nightly"}
    assert created.request_counts is not None and created.request_counts.total == 14

    done = wait_for(client, created.id, ("completed", "failed"))
    assert done.status == "completed", done
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (12, 2)
    outputs = results(client, done.output_file_id)
    errors = results(client, done.error_file_id)
    assert sorted(o["custom_id"] for o in outputs) == sorted(f"line-{i}" for i in range(12))
    assert {e["custom_id"]: e["response"]["status_code"] for e in errors} == {
        "bad-model": 404, "bad-param": 400}
    for output in outputs:
        body = output["response"]["body"]
        assert output["response"]["status_code"] == 200 and body["object"] == "chat.completion"
        assert body["id"] == output["id"] == output["response"]["request_id"]
        assert body["usage"]["completion_tokens"] > 0
    assert client.batches.list().data[0].id == created.id

    with sqlite3.connect(database) as db:
        records = db.execute(
            "SELECT request_id, tier, status, weight_format FROM usage_records "
            "WHERE request_id LIKE ?",
            (f"batch_req_{created.id.removeprefix('batch_')}_%",)).fetchall()
    # One record per line that ran (a request the server refuses as invalid has none, as
    # over HTTP), each with the line's own id, in the batch tier, on the demo model's float
    # weights.
    assert sorted(r[0] for r in records) == sorted(o["id"] for o in outputs)
    assert {(r[1], r[2], r[3]) for r in records} == {("batch", "completed", "float32")}
    metrics = admin.get("/metrics").text
    assert f'tiergate_model_weight_format{{model="{MODEL}",weight_format="float32"}} 1.0' in (
        metrics.splitlines())
    assert _counter(metrics, "completed") >= 12 and _counter(metrics, "failed") >= 2


def _counter(metrics: str, status: str) -> float:
    prefix = f'tiergate_batch_lines_total{{status="{status}",tier="batch"}} '
    return sum(float(line[len(prefix):]) for line in metrics.splitlines()
               if line.startswith(prefix))


def test_cancel_ends_the_lines_not_started(server: ServeProcess, admin: httpx.Client) -> None:
    client = new_client(server, admin, "cancels")
    lines = [chat_line(f"c-{i}", "Tell me a story", max_tokens=64) for i in range(60)]
    file = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    cancelling = client.batches.cancel(batch.id)
    assert cancelling.status in ("cancelling", "cancelled", "completed")
    done = wait_for(client, batch.id, ("cancelled", "completed"))
    assert done.status == "cancelled", done
    ran = [o["custom_id"] for o in results(client, done.output_file_id)]
    assert len(ran) == len(set(ran)) < 60
    assert done.request_counts is not None and done.request_counts.completed == len(ran)


def test_an_expired_batch_keeps_its_results_and_ends_the_rest(
    server: ServeProcess, admin: httpx.Client, database: Path,
) -> None:
    client = new_client(server, admin, "expires")
    # Too slow to finish: each line has more tokens than the window leaves time for.
    lines = [chat_line(f"e-{i}", "Tell me a story", max_tokens=200) for i in range(40)]
    file = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    with sqlite3.connect(database) as db:  # its 24 hours have passed
        db.execute("UPDATE batches SET expires_at = '2000-01-01 00:00:00' WHERE id = ?",
                   (batch.id,))
    done = wait_for(client, batch.id, ("expired",))
    outputs = results(client, done.output_file_id)
    errors = results(client, done.error_file_id)
    assert {e["error"]["code"] for e in errors if e["error"]} <= {"batch_expired"}
    assert sorted(r["custom_id"] for r in outputs + errors) == sorted(
        f"e-{i}" for i in range(40))


def test_a_budget_reached_mid_batch_stops_it_without_overspending(
    server: ServeProcess, admin: httpx.Client, database: Path,
) -> None:
    budget = 400
    client = new_client(server, admin, "budgeted", {"monthly_token_budget": budget})
    lines = [chat_line(f"b-{i}", "Say hi", max_tokens=16) for i in range(40)]
    file = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    done = wait_for(client, batch.id, ("failed", "completed"))
    assert done.status == "failed", done
    assert done.errors is not None and done.errors.data
    assert done.errors.data[0].code == "budget_exceeded"
    outputs = results(client, done.output_file_id)
    errors = results(client, done.error_file_id)
    assert sorted(r["custom_id"] for r in outputs + errors) == sorted(
        f"b-{i}" for i in range(40))
    assert errors and outputs
    with sqlite3.connect(database) as db:
        [(used,)] = db.execute(
            "SELECT COALESCE(SUM(num_prompt_tokens + num_completion_tokens), 0) "
            "FROM usage_records WHERE request_id LIKE ?",
            (f"batch_req_{batch.id.removeprefix('batch_')}_%",)).fetchall()
    assert used <= budget
    assert _counter(admin.get("/metrics").text, "budget_stopped") >= 1


def test_lines_over_the_rate_limit_wait_for_their_retry_after(
    server: ServeProcess, admin: httpx.Client,
) -> None:
    client = new_client(server, admin, "throttled",
                        {"requests_per_minute": 120, "burst_requests": 2})
    lines = [chat_line(f"t-{i}", "Say hi") for i in range(8)]
    file = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")
    before = _counter(admin.get("/metrics").text, "retried")
    done = wait_for(client, batch.id, ("completed",))
    assert done.request_counts is not None
    assert (done.request_counts.completed, done.request_counts.failed) == (8, 0)
    # Two requests at once, then one every half second: the others were given back.
    assert _counter(admin.get("/metrics").text, "retried") > before


def test_another_tenants_batch_is_a_404_and_bad_creates_are_400s(
    server: ServeProcess, admin: httpx.Client,
) -> None:
    mine = new_client(server, admin, "owner")
    other = new_client(server, admin, "stranger")
    file = mine.files.create(file=("in.jsonl", jsonl([chat_line("x", "hi")])), purpose="batch")
    batch = mine.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                completion_window="24h")
    with pytest.raises(openai.NotFoundError):
        other.batches.retrieve(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.cancel(batch.id)
    with pytest.raises(openai.NotFoundError):
        other.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                             completion_window="24h")
    with pytest.raises(openai.BadRequestError) as wrong_endpoint:
        mine.batches.create(input_file_id=file.id, endpoint="/v1/completions",
                            completion_window="24h")
    assert wrong_endpoint.value.code == "invalid_batch_line"
    with pytest.raises(openai.BadRequestError) as wrong_window:
        mine.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                            completion_window="1h")  # type: ignore[arg-type]
    assert isinstance(wrong_window.value.body, dict)
    assert wrong_window.value.body["param"] == "completion_window"
    wait_for(mine, batch.id, ("completed",))
