"""kill -9 one of two replicas sharing PostgreSQL, Redis and an S3-compatible store (moto's
server) in the middle of a batch: the other takes over its lines once their leases lapse, the
batch completes, each custom_id is in the output or error file exactly once, and the ledger
holds one record per line that ran."""

from __future__ import annotations

import json
import signal
import time
from collections.abc import Iterator
from pathlib import Path

import boto3
import httpx
import openai
import pytest
from moto.server import ThreadedMotoServer
from sqlalchemy import create_engine, text

import migrations
from tests.gateway.admission_support import (
    SHARED_REDIS_URL,
    delete_redis_prefix,
    new_key_prefix,
    start_all,
    write_config,
)
from tests.gateway.batches.test_batches_api import chat_line, jsonl, results, wait_for
from tests.serve_process import ADMIN_TOKEN, ServeProcess, free_port
from tests.tenants.conftest import scratch_database

BUCKET = "tiergate-batches"
NUM_LINES = 120


@pytest.fixture
def replicas(tmp_path: Path) -> Iterator[tuple[list[ServeProcess], str]]:
    port = free_port()
    moto = ThreadedMotoServer(ip_address="127.0.0.1", port=port)
    moto.start()
    endpoint = f"http://127.0.0.1:{port}"
    aws = {"AWS_ENDPOINT_URL": endpoint, "AWS_ACCESS_KEY_ID": "test",
           "AWS_SECRET_ACCESS_KEY": "test", "AWS_DEFAULT_REGION": "us-east-1"}
    boto3.client("s3", endpoint_url=endpoint, aws_access_key_id="test",
                 aws_secret_access_key="test", region_name="us-east-1"
                 ).create_bucket(Bucket=BUCKET)
    prefix = new_key_prefix()
    config = write_config(tmp_path / "replicas.json", {"admission": {
        "enable_shedding": False, "num_replicas": 2, "redis_key_prefix": prefix}})
    try:
        with scratch_database("postgresql", tmp_path) as database_url:
            migrations.upgrade_head(database_url)
            processes = [
                ServeProcess(database_url, env=aws, args=[
                    "--no-migrate", "--redis-url", SHARED_REDIS_URL, "--config", str(config),
                    "--file-storage", f"s3://{BUCKET}", "--batch-lease-s", "3",
                    "--batch-max-in-flight", "4"])
                for _ in range(2)
            ]
            try:
                start_all(processes)
                yield processes, database_url
            finally:
                for process in processes:
                    process.kill()
    finally:
        delete_redis_prefix(SHARED_REDIS_URL, prefix)
        moto.stop()


def test_a_killed_replicas_lines_are_taken_over_and_each_runs_into_the_files_once(
    replicas: tuple[list[ServeProcess], str],
) -> None:
    (survivor, victim), database_url = replicas
    with httpx.Client(base_url=survivor.base_url,
                      headers={"x-admin-token": ADMIN_TOKEN}) as admin:
        tenant = admin.post("/admin/v1/tenants", json={"name": "nightly", "tier": "standard"})
        assert tenant.status_code == 201, tenant.text
        key = admin.post(f"/admin/v1/tenants/{tenant.json()['id']}/keys", json={"name": "k"})
    client = openai.OpenAI(base_url=f"{survivor.base_url}/v1", api_key=key.json()["key"],
                           max_retries=0)
    lines = [chat_line(f"r-{i}", f"Count to {i % 7}", max_tokens=24) for i in range(NUM_LINES)]
    file = client.files.create(file=("in.jsonl", jsonl(lines)), purpose="batch")
    batch = client.batches.create(input_file_id=file.id, endpoint="/v1/chat/completions",
                                  completion_window="24h")

    engine = create_engine(database_url)

    def claimers() -> set[str]:
        with engine.connect() as connection:
            return set(connection.execute(text(
                "SELECT DISTINCT claimed_by FROM batch_lines WHERE batch_id = :b "
                "AND status = 'running'"), {"b": batch.id}).scalars())

    # Both replicas run lines; once some are done, one dies with its claims held. The victim
    # is frozen (SIGSTOP) before its claims are read, so it cannot finish them between the
    # read and the kill; a freeze that catches it between claims thaws it and tries again.
    assert victim.process is not None
    deadline = time.monotonic() + 120
    while True:
        counts = client.batches.retrieve(batch.id).request_counts
        assert counts is not None
        if counts.completed >= NUM_LINES // 4:
            victim.process.send_signal(signal.SIGSTOP)
            if len(claimers()) == 2:
                break
            victim.process.send_signal(signal.SIGCONT)
        assert time.monotonic() < deadline
        time.sleep(0.05)
    victim.kill()
    assert len(claimers()) == 2  # the dead replica's claims, until their leases lapse

    done = wait_for(client, batch.id, ("completed",), timeout_s=300)
    outputs = results(client, done.output_file_id)
    errors = results(client, done.error_file_id)
    ids = [r["custom_id"] for r in outputs + errors]
    assert sorted(ids) == sorted(f"r-{i}" for i in range(NUM_LINES)), errors[:3]
    assert done.request_counts is not None
    assert done.request_counts.completed == len(outputs)

    try:
        with engine.connect() as connection:
            unfinished = connection.execute(text(
                "SELECT COUNT(*) FROM batch_lines WHERE batch_id = :b AND status <> 'done'"),
                {"b": batch.id}).scalar_one()
            recorded = connection.execute(text(
                "SELECT request_id FROM usage_records WHERE request_id LIKE :p"),
                {"p": f"batch_req_{batch.id.removeprefix('batch_')}_%"}).scalars().all()
    finally:
        engine.dispose()
    assert unfinished == 0
    # One record per line that ran: a line the dead replica ran (and recorded) but never
    # stored ran again on the survivor under the same request id, which the ledger keeps once.
    assert sorted(recorded) == sorted(o["id"] for o in outputs), json.dumps(errors[:2])
