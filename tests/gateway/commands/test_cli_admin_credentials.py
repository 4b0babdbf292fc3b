"""`tiergate admin-credentials create|list|revoke` through gateway.cli.main, on SQLite and
PostgreSQL."""

from __future__ import annotations

import json

import pytest
from sqlalchemy.orm import Session

import tenants
from tests.gateway.commands.test_cli_tenants import Cli


@pytest.fixture
def cli(database_url: str, db: object, capsys: pytest.CaptureFixture[str]) -> Cli:
    return Cli(database_url, capsys)


def test_create_list_revoke(cli: Cli, session: Session) -> None:
    status, out, err = cli("admin-credentials", "create", "alice", "--role", "billing",
                           "--json")
    assert status == 0 and "cannot be shown again" in err
    created = json.loads(out)
    secret = created["secret"]
    assert secret.startswith("tga-") and created["prefix"] == secret[:len(created["prefix"])]
    assert (created["name"], created["role"], created["revoked_at"]) == ("alice", "billing", None)
    found = tenants.find_admin_credential(session, secret)
    assert found is not None and found.id == created["id"]

    status, out, _ = cli("admin-credentials", "list")
    assert out.splitlines()[0].split()[:4] == ["id", "name", "role", "prefix"]
    assert created["prefix"] in out and secret not in out
    listed = cli.json("admin-credentials", "list")
    assert [c["id"] for c in listed] == [created["id"]] and "secret" not in listed[0]

    revoked = cli.json("admin-credentials", "revoke", str(created["id"]))
    assert revoked["revoked_at"] is not None
    assert cli.json("admin-credentials", "list", "--active") == []
    assert [c["id"] for c in cli.json("admin-credentials", "list")] == [created["id"]]
    entries = tenants.list_audit_entries(session, target_type="admin_credential")
    assert [e.action for e in entries] == ["admin_credential.revoke", "admin_credential.create"]
    assert all(e.actor.startswith("cli:") for e in entries)
    assert all(secret not in json.dumps(e.after) for e in entries)


@pytest.mark.parametrize(("args", "message"), [
    (("admin-credentials", "revoke", "999999"), "no admin credential with id 999999"),
    (("admin-credentials", "create", ""), "(name)"),
])
def test_errors_exit_1_with_a_message(cli: Cli, args: tuple[str, ...], message: str) -> None:
    status, _, err = cli(*args, *(("--role", "owner") if "create" in args else ()))
    assert status == 1 and message in err


def test_a_role_is_required_and_must_be_known(cli: Cli) -> None:
    for args in (("admin-credentials", "create", "bob"),
                 ("admin-credentials", "create", "bob", "--role", "admin")):
        with pytest.raises(SystemExit) as exited:
            cli(*args)
        assert exited.value.code == 2
