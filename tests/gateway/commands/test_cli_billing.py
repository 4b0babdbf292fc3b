"""`tiergate billing export` through gateway.cli.main on SQLite and PostgreSQL, and once in a
real terminal (a pseudo-terminal) for the progress bar."""

from __future__ import annotations

import csv
import io
import json
import os
import pty
import subprocess
import sys
from pathlib import Path

import pytest
from sqlalchemy.orm import Session

from billing import DAILY_COLUMNS, ExportFormat, ExportRequest, Period, UsageRecord, export_lines
from gateway.cli import main
from tests.billing.factories import SeededMonth, bulk_insert, make_record, seed_month


class Cli:
    """Runs `tiergate billing export ARGS --database-url URL`: (exit status, stdout, stderr)."""

    def __init__(self, url: str, capsys: pytest.CaptureFixture[str]) -> None:
        self.url = url
        self._capsys = capsys

    def __call__(self, *args: str) -> tuple[int, str, str]:
        self._capsys.readouterr()
        status = main(["billing", "export", *args, "--database-url", self.url, "--no-migrate"])
        out, err = self._capsys.readouterr()
        return status, out, err


@pytest.fixture
def cli(database_url: str, db: object, capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(database_url, capsys)


@pytest.fixture
def month(session: Session) -> SeededMonth:
    seeded = seed_month(session)
    session.commit()
    return seeded


def test_daily_csv_to_stdout(cli: Cli, month: SeededMonth, session: Session) -> None:
    status, out, err = cli("--period", "2026-11")
    assert (status, err) == (0, "")  # not a terminal: no progress bar
    assert out == "".join(export_lines(session, ExportRequest(Period(2026, 11), ExportFormat.CSV)))
    rows = list(csv.DictReader(io.StringIO(out)))
    assert tuple(rows[0]) == DAILY_COLUMNS
    assert sum(int(row["amount_usd_micros"]) for row in rows) == 2860


def test_tenant_by_name_or_id_and_detail_jsonl(cli: Cli, month: SeededMonth) -> None:
    by_name = cli("--period", "2026-11", "--tenant", "globex", "--format", "jsonl", "--detail")
    by_id = cli(
        "--period", "2026-11", "--tenant", str(month.globex_id), "--format", "jsonl", "--detail"
    )  # fmt: skip
    assert by_name[0] == 0 and by_name == by_id
    records = [UsageRecord.from_json(json.loads(line)) for line in by_name[1].splitlines()]
    assert sorted(r.request_id for r in records) == ["a3", "g1", "g2", "g3"]

    # A deleted tenant's records are still exported by id.
    status, out, _ = cli("--period", "2026-11", "--tenant", str(month.deleted_id), "--detail")
    assert status == 0 and [line.split(",")[0] for line in out.splitlines()] == [
        "request_id",
        "d1",
    ]


def test_output_file(cli: Cli, month: SeededMonth, tmp_path: Path) -> None:
    target = tmp_path / "november.jsonl"
    status, out, err = cli("--period", "2026-11", "--format", "jsonl", "--output", str(target))
    assert (status, out, err) == (0, "", "")
    assert [json.loads(line)["date"] for line in target.read_text().splitlines()] == [
        "2026-11-01",
        "2026-11-01",
        "2026-11-02",
        "2026-11-03",
        "2026-11-03",
        "2026-11-30",
    ]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["november.jsonl"]  # no .partial left


def test_errors(cli: Cli, month: SeededMonth, tmp_path: Path) -> None:
    status, out, err = cli("--period", "2026-11", "--tenant", "nobody")
    assert (status, out) == (1, "") and "nobody" in err
    status, _, err = cli("--period", "2026-11", "--output", str(tmp_path / "no" / "such.csv"))
    assert status == 1 and "cannot write" in err
    with pytest.raises(SystemExit) as exited:
        cli("--period", "November")
    assert exited.value.code == 2


@pytest.mark.parametrize("database_url", ["sqlite"], indirect=True)
def test_progress_bar_on_a_terminal_only(database_url: str, db: object, session: Session) -> None:
    bulk_insert(session, [make_record(f"p{i}") for i in range(2500)])
    session.commit()
    primary, secondary = pty.openpty()
    try:
        process = subprocess.run(
            [sys.executable, "-m", "gateway.cli", "billing", "export", "--period", "2026-11",
             "--detail", "--database-url", database_url, "--no-migrate"],
            stdout=subprocess.PIPE,
            stderr=secondary,
            timeout=120,
            check=False,
        )  # fmt: skip
        os.close(secondary)
        terminal = _read_all(primary)
    finally:
        os.close(primary)
    assert process.returncode == 0, terminal
    assert len(process.stdout.decode().splitlines()) == 1 + 2500
    assert terminal.rstrip().endswith("100%  2,500/2,500 records")
    assert terminal.startswith("\r[")


def _read_all(fd: int) -> str:
    chunks = []
    while True:
        try:
            chunk = os.read(fd, 4096)
        except OSError:  # EIO: the other side of the pseudo-terminal is closed
            break
        if not chunk:
            break
        chunks.append(chunk)
    return b"".join(chunks).decode()
