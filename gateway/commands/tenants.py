"""`tiergate tenants create|list|show|update|disable|enable`, and the options shared with
`tiergate keys`: --database-url, --json, --no-migrate.

Writes are audited like admin API writes, with actor ``cli:<os user>``.
"""

from __future__ import annotations

import argparse
import getpass
import json
import sys
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

import migrations
import tenants
from tenants import QUOTA_FIELDS, DatabaseSettings, TenantStatus

_TENANT_COLUMNS = ("id", "name", "tier", "weight", "status")
_MODELS_HELP = ("served models its requests may name, comma-separated ('*': every model, the "
                "default; '': none)")


def model_list(value: str) -> list[str] | None:
    """--allowed-models: '*' for every model, else the comma-separated names."""
    if value.strip() == "*":
        return None
    return [name.strip() for name in value.split(",") if name.strip()]


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = subparsers.add_parser("tenants", help="create, list, show, update, disable tenants")
    commands = group.add_subparsers(dest="tenants_command", required=True)
    common = common_options()

    create = commands.add_parser("create", parents=[common], help="create a tenant")
    create.add_argument("name")
    create.add_argument("--tier", default="standard", help="tier name (default: standard)")
    create.add_argument("--weight", type=float, default=1.0, help="fair-share weight (> 0)")
    create.add_argument("--cache-salt", help="prefix-cache salt (default: random)")
    create.add_argument("--allowed-models", type=model_list, default=None, help=_MODELS_HELP)
    _add_quota_options(create)
    create.set_defaults(func=_create)

    listing = commands.add_parser("list", parents=[common], help="list tenants")
    listing.add_argument("--status", choices=[s.value for s in TenantStatus])
    listing.set_defaults(func=_list)

    show = commands.add_parser("show", parents=[common], help="show one tenant")
    show.add_argument("tenant", help="tenant id or name")
    show.set_defaults(func=_show)

    update = commands.add_parser("update", parents=[common], help="change a tenant or its quota")
    update.add_argument("tenant", help="tenant id or name")
    update.add_argument("--name", default=argparse.SUPPRESS)
    update.add_argument("--tier", default=argparse.SUPPRESS)
    update.add_argument("--weight", type=float, default=argparse.SUPPRESS)
    update.add_argument("--cache-salt", default=argparse.SUPPRESS)
    update.add_argument("--allowed-models", type=model_list, default=argparse.SUPPRESS,
                        help=_MODELS_HELP)
    _add_quota_options(update)
    update.set_defaults(func=_update)

    for verb, status in (("disable", TenantStatus.DISABLED), ("enable", TenantStatus.ACTIVE)):
        command = commands.add_parser(verb, parents=[common], help=f"{verb} a tenant")
        command.add_argument("tenant", help="tenant id or name")
        command.set_defaults(func=_status_setter(status))


# --- shared with gateway.commands.keys -------------------------------------------------------


def common_options() -> argparse.ArgumentParser:
    """Options every tenants/keys subcommand takes (an argparse parent parser)."""
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "--database-url",
        help=f"default: ${tenants.DATABASE_URL_ENV}, else {tenants.DEFAULT_DATABASE_URL}",
    )
    common.add_argument("--json", action="store_true", help="print JSON for scripts")
    common.add_argument(
        "--no-migrate", action="store_true", help="do not run migrations (upgrade head) first"
    )
    return common


@contextmanager
def database_session(args: argparse.Namespace) -> Iterator[Session]:
    """One transaction on the database of args, migrated to head unless --no-migrate."""
    url = args.database_url or DatabaseSettings.from_env().url
    if not args.no_migrate:
        migrations.upgrade_head(url)
    with tenants.session_scope(DatabaseSettings(url=url)) as session:
        yield session


def run_command(
    args: argparse.Namespace, work: Callable[[Session], Any], *, columns: tuple[str, ...] = ()
) -> int:
    """Run work in a session and print what it returns (a list as a table of columns).

    Errors from tenants or the database become one line on stderr and exit status 1.
    """
    try:
        with database_session(args) as session:
            result = work(session)
    except tenants.TenantsError as exc:
        param = getattr(exc, "param", None)
        print(f"tiergate: error: {exc}" + (f" ({param})" if param else ""), file=sys.stderr)
        return 1
    except SQLAlchemyError as exc:
        print(f"tiergate: database error: {exc.__class__.__name__}: {exc}", file=sys.stderr)
        return 1
    if args.json:
        print(json.dumps(result, indent=2))
    elif isinstance(result, list):
        print_table(result, columns)
    else:
        for field, value in _flatten(result):
            print(f"{field}: {'-' if value is None else value}")
    return 0


def print_table(rows: list[dict[str, Any]], columns: tuple[str, ...]) -> None:
    cells = [[str("-" if row[c] is None else row[c]) for c in columns] for row in rows]
    widths = [max([len(c), *(len(r[i]) for r in cells)]) for i, c in enumerate(columns)]
    for line in [list(columns), *cells]:
        print("  ".join(c.ljust(w) for c, w in zip(line, widths, strict=True)).rstrip())


def actor() -> str:
    try:
        return f"cli:{getpass.getuser()}"
    except (KeyError, OSError):  # no name for this uid (containers)
        return "cli:unknown"


# --- tenants ---------------------------------------------------------------------------------


def _add_quota_options(parser: argparse.ArgumentParser) -> None:
    quota = parser.add_argument_group("quota (a number, or 'unlimited')")
    for field in QUOTA_FIELDS:
        parse = _share_or_unlimited if field == "kv_cap_share" else _count_or_unlimited
        quota.add_argument(
            f"--{field.replace('_', '-')}", type=parse, default=argparse.SUPPRESS, metavar="N"
        )


def _count_or_unlimited(value: str) -> int | None:
    return None if value == "unlimited" else int(value)


def _share_or_unlimited(value: str) -> float | None:
    return None if value == "unlimited" else float(value)


def _quota(args: argparse.Namespace) -> dict[str, object]:
    return {field: getattr(args, field) for field in QUOTA_FIELDS if hasattr(args, field)}


def _create(args: argparse.Namespace) -> int:
    def work(session: Session) -> dict[str, Any]:
        tenant = tenants.create_tenant(
            session,
            name=args.name,
            tier=args.tier,
            weight=args.weight,
            cache_salt=args.cache_salt,
            allowed_models=args.allowed_models,
            quota=_quota(args),
            actor=actor(),
        )
        return tenants.tenant_snapshot(tenant)

    return run_command(args, work)


def _list(args: argparse.Namespace) -> int:
    status = None if args.status is None else TenantStatus(args.status)
    return run_command(
        args,
        lambda s: [tenants.tenant_snapshot(t) for t in tenants.list_tenants(s, status=status)],
        columns=_TENANT_COLUMNS,
    )


def _show(args: argparse.Namespace) -> int:
    return run_command(args, lambda s: tenants.tenant_snapshot(tenants.find_tenant(s, args.tenant)))


def _update(args: argparse.Namespace) -> int:
    changes: dict[str, object] = {
        field: getattr(args, field)
        for field in ("name", "tier", "weight", "cache_salt", "allowed_models")
        if hasattr(args, field)
    }
    if quota := _quota(args):
        changes["quota"] = quota

    def work(session: Session) -> dict[str, Any]:
        tenant = tenants.find_tenant(session, args.tenant)
        tenants.update_tenant(session, tenant, changes, actor=actor())
        return tenants.tenant_snapshot(tenant)

    return run_command(args, work)


def _status_setter(status: TenantStatus) -> Callable[[argparse.Namespace], int]:
    def command(args: argparse.Namespace) -> int:
        def work(session: Session) -> dict[str, Any]:
            tenant = tenants.find_tenant(session, args.tenant)
            tenants.set_tenant_status(session, tenant, status, actor=actor())
            return tenants.tenant_snapshot(tenant)

        return run_command(args, work)

    return command


def _flatten(record: dict[str, Any], prefix: str = "") -> Iterator[tuple[str, Any]]:
    for field, value in record.items():
        if isinstance(value, dict):
            yield from _flatten(value, f"{prefix}{field}.")
        else:
            yield f"{prefix}{field}", value
