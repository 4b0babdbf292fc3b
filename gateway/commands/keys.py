"""`tiergate keys create|list|rotate|models|limits|revoke`: tenant API keys; the plaintext is
printed once."""

from __future__ import annotations

import argparse
import sys
from datetime import UTC, datetime, timedelta
from decimal import Decimal, InvalidOperation
from typing import Any

from sqlalchemy.orm import Session

import tenants
from gateway.commands.tenants import actor, common_options, model_list, run_command

_KEY_COLUMNS = ("id", "tenant_id", "name", "prefix", "created_at", "last_used_at", "expires_at",
                "revoked_at", "allowed_models", *tenants.KEY_LIMIT_FIELDS)
_MODELS_HELP = ("served models the key may use, within its tenant's, comma-separated ('*': the "
                "tenant's, the default)")


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = subparsers.add_parser("keys", help="create, list, revoke tenant API keys")
    commands = group.add_subparsers(dest="keys_command", required=True)
    common = common_options()

    create = commands.add_parser("create", parents=[common], help="create a key (shown once)")
    create.add_argument("tenant", help="tenant id or name")
    create.add_argument("--name", default="default", help="a label for the key")
    expiry = create.add_mutually_exclusive_group()
    expiry.add_argument("--expires-at", help="ISO 8601 time with its zone (default: never)")
    expiry.add_argument("--expires-in-days", type=float, help="days from now until it expires")
    create.add_argument("--allowed-models", type=model_list, default=None, help=_MODELS_HELP)
    _add_limit_options(create)
    create.set_defaults(func=_create)

    listing = commands.add_parser("list", parents=[common], help="list keys (prefixes only)")
    listing.add_argument("tenant", nargs="?", help="tenant id or name (default: all tenants)")
    listing.set_defaults(func=_list)

    rotate = commands.add_parser(
        "rotate", parents=[common],
        help="a new secret for a key (shown once); the old one works for --grace-seconds")
    rotate.add_argument("key_id", type=int)
    rotate.add_argument("--grace-seconds", type=int, default=0,
                        help="how long the old secret keeps working (default 0: not at all)")
    rotate.set_defaults(func=_rotate)

    models = commands.add_parser("models", parents=[common],
                                 help="set the models a key may use, within its tenant's")
    models.add_argument("key_id", type=int)
    models.add_argument("allowed_models", type=model_list, help=_MODELS_HELP)
    models.set_defaults(func=_models)

    limits = commands.add_parser(
        "limits", parents=[common],
        help="set a key's own limits inside its tenant's (options not given are kept)")
    limits.add_argument("key_id", type=int)
    _add_limit_options(limits)
    limits.set_defaults(func=_limits)

    revoke = commands.add_parser("revoke", parents=[common], help="revoke a key")
    revoke.add_argument("key_id", type=int)
    revoke.set_defaults(func=_revoke)


def _create(args: argparse.Namespace) -> int:
    def work(session: Session) -> dict[str, Any]:
        tenant = tenants.find_tenant(session, args.tenant)
        expires_at: object = args.expires_at
        if args.expires_in_days is not None:
            expires_at = datetime.now(UTC) + timedelta(days=args.expires_in_days)
        created = tenants.create_api_key(session, tenant, name=args.name, actor=actor(),
                                         expires_at=expires_at,
                                         allowed_models=args.allowed_models,
                                         limits=_key_limits(args))
        return {**tenants.api_key_snapshot(created.api_key), "key": created.plaintext}

    status = run_command(args, work)
    if status == 0:
        print("Store this key now: it cannot be shown again.", file=sys.stderr)
    return status


def _list(args: argparse.Namespace) -> int:
    def work(session: Session) -> list[dict[str, Any]]:
        tenant_id = None if args.tenant is None else tenants.find_tenant(session, args.tenant).id
        return [
            tenants.api_key_snapshot(k) for k in tenants.list_api_keys(session, tenant_id=tenant_id)
        ]

    return run_command(args, work, columns=_KEY_COLUMNS)


def _rotate(args: argparse.Namespace) -> int:
    def work(session: Session) -> dict[str, Any]:
        rotated = tenants.rotate_api_key(session, tenants.get_api_key(session, args.key_id),
                                         grace_s=args.grace_seconds, actor=actor())
        return {**tenants.api_key_snapshot(rotated.api_key), "key": rotated.plaintext}

    status = run_command(args, work)
    if status == 0:
        print("Store this key now: it cannot be shown again.", file=sys.stderr)
    return status


def _models(args: argparse.Namespace) -> int:
    def work(session: Session) -> dict[str, Any]:
        api_key = tenants.set_api_key_models(session, tenants.get_api_key(session, args.key_id),
                                             allowed_models=args.allowed_models, actor=actor())
        return tenants.api_key_snapshot(api_key)

    return run_command(args, work)


def _limits(args: argparse.Namespace) -> int:
    limits = _key_limits(args)
    if not limits:
        print("tiergate: error: nothing to change: give at least one limit option",
              file=sys.stderr)
        return 2

    def work(session: Session) -> dict[str, Any]:
        api_key = tenants.set_api_key_limits(session, tenants.get_api_key(session, args.key_id),
                                             limits=limits, actor=actor())
        return tenants.api_key_snapshot(api_key)

    return run_command(args, work)


def _add_limit_options(parser: argparse.ArgumentParser) -> None:
    group = parser.add_argument_group(
        "the key's own limits, binding before its tenant's ('none': only the tenant's)")
    for field in ("requests_per_minute", "tokens_per_minute", "monthly_token_budget"):
        group.add_argument(f"--{field.replace('_', '-')}", type=_count_or_none, metavar="N",
                           default=argparse.SUPPRESS)
    group.add_argument("--monthly-spend-budget-usd", type=_usd_micros_or_none, metavar="USD",
                       dest="monthly_spend_budget_usd_micros", default=argparse.SUPPRESS,
                       help="in dollars, e.g. 25 or 12.50 (kept in micro-dollars)")


def _key_limits(args: argparse.Namespace) -> dict[str, object]:
    return {field: getattr(args, field) for field in tenants.KEY_LIMIT_FIELDS
            if hasattr(args, field)}


def _count_or_none(value: str) -> int | None:
    """An integer, or None for 'none'; the range is checked by tenants (one message for the
    CLI and the admin API)."""
    if value.lower() == "none":
        return None
    try:
        return int(value)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer or 'none': {value!r}") from None


def _usd_micros_or_none(value: str) -> int | None:
    """Dollars as whole micro-dollars (exact: no float rounding), or None for 'none'."""
    if value.lower() == "none":
        return None
    try:
        micros = Decimal(value) * 1_000_000
    except InvalidOperation:
        raise argparse.ArgumentTypeError(f"not an amount in dollars or 'none': {value!r}") from None
    if not micros.is_finite() or micros != micros.to_integral_value():
        raise argparse.ArgumentTypeError(f"not a whole number of micro-dollars: {value!r}")
    return int(micros)


def _revoke(args: argparse.Namespace) -> int:
    def work(session: Session) -> dict[str, Any]:
        api_key = tenants.get_api_key(session, args.key_id)
        return tenants.api_key_snapshot(tenants.revoke_api_key(session, api_key, actor=actor()))

    return run_command(args, work)
