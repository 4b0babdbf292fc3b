"""`tiergate batches list|show` and `tiergate files list`: a tenant's batches (their status,
line counts and result files) and uploaded files, read from the database."""

from __future__ import annotations

import argparse
from typing import Any

from sqlalchemy.orm import Session

import tenants
from gateway.batches.api import batch_object
from gateway.commands.tenants import common_options, run_command
from gateway.files.api import file_object

_BATCH_COLUMNS = ("id", "tenant_id", "endpoint", "status", "total", "completed", "failed",
                  "created_at", "output_file_id", "error_file_id")
_FILE_COLUMNS = ("id", "tenant_id", "filename", "purpose", "bytes", "created_at")
MAX_ROWS = 1000


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    batches = subparsers.add_parser("batches", help="list and show batches (the Batches API)")
    commands = batches.add_subparsers(dest="batches_command", required=True)
    common = common_options()
    listing = commands.add_parser("list", parents=[common], help="list batches, newest first")
    listing.add_argument("tenant", nargs="?", help="tenant id or name (default: all tenants)")
    listing.add_argument("--status", help="only batches in this status (e.g. in_progress)")
    listing.set_defaults(func=_list_batches)
    show = commands.add_parser("show", parents=[common], help="one batch, as the API shows it")
    show.add_argument("batch_id")
    show.set_defaults(func=_show_batch)

    files = subparsers.add_parser("files", help="list uploaded files (the Files API)")
    file_commands = files.add_subparsers(dest="files_command", required=True)
    file_listing = file_commands.add_parser("list", parents=[common],
                                            help="list files, newest first")
    file_listing.add_argument("tenant", nargs="?",
                              help="tenant id or name (default: all tenants)")
    file_listing.set_defaults(func=_list_files)


def _tenant_id(session: Session, tenant: str | None) -> int | None:
    return None if tenant is None else tenants.find_tenant(session, tenant).id


def _batch_row(session: Session, batch: tenants.Batch) -> dict[str, Any]:
    shown = batch_object(batch, tenants.line_counts(session, batch.id))
    return {**shown, "tenant_id": batch.tenant_id, **shown["request_counts"],
            "created_at": batch.created_at.isoformat(timespec="seconds")}


def _list_batches(args: argparse.Namespace) -> int:
    def work(session: Session) -> list[dict[str, Any]]:
        batches = tenants.list_batches(session, _tenant_id(session, args.tenant), after=None,
                                       limit=MAX_ROWS, status=args.status)
        return [_batch_row(session, batch) for batch in batches]

    return run_command(args, work, columns=_BATCH_COLUMNS)


def _show_batch(args: argparse.Namespace) -> int:
    def work(session: Session) -> dict[str, Any]:
        batch = session.get(tenants.Batch, args.batch_id)
        if batch is None:
            raise tenants.RowNotFoundError(f"no batch with id {args.batch_id!r}")
        return _batch_row(session, batch)

    return run_command(args, work)


def _list_files(args: argparse.Namespace) -> int:
    def work(session: Session) -> list[dict[str, Any]]:
        rows = tenants.list_files(session, _tenant_id(session, args.tenant), purpose=None,
                                  after=None, limit=MAX_ROWS, newest_first=True)
        return [{**file_object(row), "tenant_id": row.tenant_id,
                 "created_at": row.created_at.isoformat(timespec="seconds")} for row in rows]

    return run_command(args, work, columns=_FILE_COLUMNS)
