"""`tiergate batches list|show` and `tiergate files list` through gateway.cli.main, on SQLite
and PostgreSQL: a tenant's batches with their line counts, and its files."""

from __future__ import annotations

from datetime import UTC, datetime, timedelta

import pytest
from sqlalchemy.orm import Session

import tenants
from tests.gateway.commands.test_cli_tenants import Cli

BATCH_ID = "batch_" + "c" * 32
FILE_ID = "file-" + "d" * 24


@pytest.fixture
def cli(database_url: str, db: object, capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(database_url, capsys)


def _batch_of(session: Session, tenant: str) -> None:
    created = tenants.create_tenant(session, name=tenant, tier="standard", actor="test")
    now = datetime.now(UTC)
    session.add(tenants.StoredFile(id=FILE_ID, tenant_id=created.id, filename="in.jsonl",
                                   purpose="batch", bytes=100, num_lines=3, created_at=now))
    session.add(tenants.Batch(id=BATCH_ID, tenant_id=created.id, api_key_id=None,
                              endpoint="/v1/completions", input_file_id=FILE_ID,
                              completion_window="24h", status="in_progress", total=3,
                              created_at=now, in_progress_at=now,
                              expires_at=now + timedelta(days=1)))
    session.flush()
    session.add_all(
        tenants.BatchLine(batch_id=BATCH_ID, line_index=i, custom_id=f"c{i}", body={},
                          prefix_key="", status=status, attempts=0, is_error=is_error,
                          result=None)
        for i, (status, is_error) in enumerate(
            [("done", False), ("done", True), ("pending", False)]))
    session.commit()


def test_batches_and_files_of_a_tenant(cli: Cli, session: Session) -> None:
    _batch_of(session, "nightly")
    [listed] = cli.json("batches", "list", "nightly")
    assert (listed["id"], listed["status"], listed["tenant_id"]) == (
        BATCH_ID, "in_progress", listed["tenant_id"])
    assert (listed["total"], listed["completed"], listed["failed"]) == (3, 1, 1)
    assert cli.json("batches", "list", "--status", "completed") == []
    shown = cli.json("batches", "show", BATCH_ID)
    assert shown["request_counts"] == {"total": 3, "completed": 1, "failed": 1}
    status, out, _ = cli("batches", "list")
    assert status == 0 and out.splitlines()[0].split()[:4] == [
        "id", "tenant_id", "endpoint", "status"] and BATCH_ID in out
    [file] = cli.json("files", "list", "nightly")
    assert (file["id"], file["filename"], file["bytes"]) == (FILE_ID, "in.jsonl", 100)
    status, _, err = cli("batches", "show", "batch_" + "0" * 32)
    assert status == 1 and "no batch" in err
