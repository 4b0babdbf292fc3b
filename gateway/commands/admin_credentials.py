"""`tiergate admin-credentials create|list|revoke`: the named secrets that open the admin API,
each with one role (read-only, billing, operator, owner); a secret is printed once.

They work on the database directly (no running replica needed); replicas see a new or
revoked credential within their credential cache's TTL. Writes are audited with actor
``cli:<os user>``.
"""

from __future__ import annotations

import argparse
import sys
from typing import Any

from sqlalchemy.orm import Session

import tenants
from gateway.commands.tenants import actor, common_options, run_command
from tenants import AdminRole

_COLUMNS = ("id", "name", "role", "prefix", "created_at", "last_used_at", "revoked_at")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = subparsers.add_parser(
        "admin-credentials", help="create, list, revoke admin API credentials (with roles)")
    commands = group.add_subparsers(dest="admin_credentials_command", required=True)
    common = common_options()

    create = commands.add_parser("create", parents=[common],
                                 help="create a credential (its secret is shown once)")
    create.add_argument("name", help="who or what holds it; the audit log names it")
    create.add_argument("--role", required=True, choices=[r.value for r in AdminRole],
                        help="read-only: every read; billing: reads and billing exports; "
                             "operator: reads and changes to tenants, quotas, keys, adapters; "
                             "owner: everything")
    create.set_defaults(func=_create)

    listing = commands.add_parser("list", parents=[common],
                                  help="list credentials (prefixes only, never secrets)")
    listing.add_argument("--active", action="store_true", help="leave revoked ones out")
    listing.set_defaults(func=_list)

    revoke = commands.add_parser("revoke", parents=[common], help="revoke a credential")
    revoke.add_argument("credential_id", type=int)
    revoke.set_defaults(func=_revoke)


def _create(args: argparse.Namespace) -> int:
    def work(session: Session) -> dict[str, Any]:
        created = tenants.create_admin_credential(session, name=args.name, role=args.role,
                                                  actor=actor())
        return {**tenants.admin_credential_snapshot(created.credential),
                "secret": created.plaintext}

    status = run_command(args, work)
    if status == 0:
        print("Store this secret now: it cannot be shown again.", file=sys.stderr)
    return status


def _list(args: argparse.Namespace) -> int:
    def work(session: Session) -> list[dict[str, Any]]:
        return [tenants.admin_credential_snapshot(c) for c in
                tenants.list_admin_credentials(session, include_revoked=not args.active)]

    return run_command(args, work, columns=_COLUMNS)


def _revoke(args: argparse.Namespace) -> int:
    def work(session: Session) -> dict[str, Any]:
        credential = tenants.get_admin_credential(session, args.credential_id)
        return tenants.admin_credential_snapshot(
            tenants.revoke_admin_credential(session, credential, actor=actor()))

    return run_command(args, work)
