"""`tiergate tenants ...` and `tiergate keys ...` through gateway.cli.main, on SQLite and
PostgreSQL; one run of the installed console script on a new SQLite file."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
from sqlalchemy.orm import Session

import migrations
import tenants
from gateway.cli import main
from tenants.keys import PREFIX_LENGTH


class Cli:
    """Runs `tiergate ARGS --database-url URL`, returning (exit status, stdout, stderr)."""

    def __init__(self, url: str, capsys: pytest.CaptureFixture[str]) -> None:
        self.url = url
        self._capsys = capsys

    def __call__(self, *args: str) -> tuple[int, str, str]:
        self._capsys.readouterr()
        status = main([*args, "--database-url", self.url, "--no-migrate"])
        out, err = self._capsys.readouterr()
        return status, out, err

    def json(self, *args: str) -> Any:
        status, out, err = self(*args, "--json")
        assert status == 0, err
        return json.loads(out)


@pytest.fixture
def cli(database_url: str, db: object, capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(database_url, capsys)


def test_tenant_lifecycle(cli: Cli) -> None:
    created = cli.json(
        "tenants", "create", "acme", "--tier", "premium", "--weight", "2",
        "--requests-per-minute", "600", "--kv-cap-share", "0.25",
    )  # fmt: skip
    assert (created["name"], created["tier"], created["weight"]) == ("acme", "premium", 2.0)
    assert created["quota"]["requests_per_minute"] == 600
    assert created["quota"]["kv_cap_share"] == 0.25

    assert cli.json("tenants", "show", "acme") == created
    assert cli.json("tenants", "show", str(created["id"])) == created

    updated = cli.json(
        "tenants", "update", "acme", "--requests-per-minute", "unlimited",
        "--monthly-token-budget", "1000000", "--tier", "batch",
    )  # fmt: skip
    assert updated["tier"] == "batch"
    assert updated["weight"] == 2.0
    assert updated["quota"]["requests_per_minute"] is None
    assert updated["quota"]["monthly_token_budget"] == 1_000_000
    assert updated["quota"]["kv_cap_share"] == 0.25

    assert cli.json("tenants", "disable", "acme")["status"] == "disabled"
    assert cli.json("tenants", "list", "--status", "disabled")[0]["name"] == "acme"
    assert cli.json("tenants", "list", "--status", "active") == []
    assert cli.json("tenants", "enable", "acme")["status"] == "active"


def test_human_output(cli: Cli) -> None:
    status, out, _ = cli("tenants", "create", "acme")
    assert status == 0 and "name: acme" in out and "quota.requests_per_minute: -" in out
    status, out, _ = cli("tenants", "list")
    assert out.splitlines()[0].split() == ["id", "name", "tier", "weight", "status"]
    assert out.splitlines()[1].split()[1:] == ["acme", "standard", "1.0", "active"]


def test_keys_create_list_revoke(cli: Cli, session: Session) -> None:
    cli.json("tenants", "create", "acme")
    status, out, err = cli("keys", "create", "acme", "--name", "ci", "--json")
    assert status == 0 and "cannot be shown again" in err
    created = json.loads(out)
    key = created["key"]
    assert key.startswith("tg-") and created["prefix"] == key[:PREFIX_LENGTH]

    status, out, _ = cli("keys", "list", "acme")
    assert created["prefix"] in out and key not in out
    listed = cli.json("keys", "list")
    assert [k["prefix"] for k in listed] == [created["prefix"]]
    assert "key" not in listed[0]

    status, out, err = cli("keys", "rotate", str(created["id"]), "--grace-seconds", "600",
                           "--json")
    assert status == 0 and "cannot be shown again" in err
    rotated = json.loads(out)
    assert rotated["id"] == created["id"] and rotated["previous_expires_at"] is not None
    old, new = tenants.find_api_key(session, key), tenants.find_api_key(session, rotated["key"])
    assert old is not None and old.is_previous and new is not None and not new.is_previous
    session.expire_all()

    revoked = cli.json("keys", "revoke", str(created["id"]))
    assert revoked["revoked_at"] is not None
    found = tenants.find_api_key(session, rotated["key"])
    assert found is not None and found.api_key.is_revoked


def test_keys_limits_set_keep_and_clear_a_keys_own_limits(cli: Cli, session: Session) -> None:
    cli.json("tenants", "create", "acme")
    created = cli.json("keys", "create", "acme", "--requests-per-minute", "5",
                       "--monthly-spend-budget-usd", "12.50")
    assert (created["requests_per_minute"], created["monthly_spend_budget_usd_micros"]) == (
        5, 12_500_000)
    key_id = str(created["id"])
    changed = cli.json("keys", "limits", key_id, "--tokens-per-minute", "2000",
                       "--monthly-token-budget", "100000", "--requests-per-minute", "none")
    assert (changed["requests_per_minute"], changed["tokens_per_minute"],
            changed["monthly_token_budget"], changed["monthly_spend_budget_usd_micros"]) == (
        None, 2000, 100_000, 12_500_000)  # what no option names is kept
    cleared = cli.json("keys", "limits", key_id, "--monthly-spend-budget-usd", "none")
    assert cleared["monthly_spend_budget_usd_micros"] is None
    status, _, err = cli("keys", "limits", key_id, "--tokens-per-minute", "-3")
    assert status == 1 and "(tokens_per_minute)" in err
    status, _, err = cli("keys", "limits", key_id)
    assert status == 2 and "nothing to change" in err
    with pytest.raises(SystemExit):  # argparse: not a number of dollars
        cli("keys", "limits", key_id, "--monthly-spend-budget-usd", "lots")
    entries = tenants.list_audit_entries(session, target_type="api_key")
    assert [e.action for e in entries] == ["api_key.update", "api_key.update", "api_key.create"]
    assert entries[1].before is not None and entries[1].after is not None
    assert entries[1].before["requests_per_minute"] == 5
    assert entries[1].after["requests_per_minute"] is None


def test_cli_writes_are_audited(cli: Cli, session: Session) -> None:
    cli.json("tenants", "create", "acme")
    cli.json("tenants", "update", "acme", "--weight", "3")
    entries = tenants.list_audit_entries(session)
    assert [e.action for e in entries] == ["tenant.update", "tenant.create"]
    assert all(e.actor.startswith("cli:") for e in entries)


@pytest.mark.parametrize(
    ("args", "message"),
    [
        (("tenants", "show", "nobody"), "no tenant named 'nobody'"),
        (("tenants", "create", "Bad"), "(name)"),
        (("tenants", "create", "acme", "--tier", "gold"), "(tier)"),
        (("tenants", "update", "acme", "--kv-cap-share", "2"), "(quota.kv_cap_share)"),
        (("tenants", "update", "acme", "--weight", "0"), "(weight)"),
        (("keys", "create", "nobody"), "no tenant named"),
        (("keys", "revoke", "999999"), "no API key with id 999999"),
    ],
)
def test_errors_exit_1_with_a_message(cli: Cli, args: tuple[str, ...], message: str) -> None:
    if args[1] == "update":
        cli.json("tenants", "create", "acme")
    status, out, err = cli(*args)
    assert status == 1 and out == ""
    assert err.startswith("tiergate: error:") and message in err


def test_duplicate_name_exits_1(cli: Cli) -> None:
    cli.json("tenants", "create", "acme")
    status, _, err = cli("tenants", "create", "acme")
    assert status == 1 and "already exists" in err


def test_unreachable_database_exits_1(capsys: pytest.CaptureFixture[str]) -> None:
    url = "postgresql+psycopg://postgres@127.0.0.1:1/test?connect_timeout=2"
    assert main(["tenants", "list", "--database-url", url]) == 1
    assert "database error" in capsys.readouterr().err


def test_console_script_migrates_a_new_sqlite_file_by_default(tmp_path: Path) -> None:
    # The default database is ./tiergate.db where the command runs; commands migrate it first.
    env = {k: v for k, v in os.environ.items() if k != "TIERGATE_DATABASE_URL"}
    script = Path(sys.executable).parent / "tiergate"

    def run(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run(
            [str(script), *args], cwd=tmp_path, env=env, capture_output=True, text=True, timeout=60
        )

    created = run("tenants", "create", "acme", "--json")
    assert created.returncode == 0, created.stderr
    assert json.loads(created.stdout)["name"] == "acme"
    url = f"sqlite:///{tmp_path / 'tiergate.db'}"
    assert migrations.current_revision(url) == migrations.head_revision()
    listed = run("tenants", "list", "--json")
    assert [t["name"] for t in json.loads(listed.stdout)] == ["acme"]
