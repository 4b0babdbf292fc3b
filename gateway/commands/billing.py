"""`tiergate billing export`: a month of usage as CSV or JSON Lines, to stdout or a file.

A line per tenant per UTC day by default, or every record with --detail. Long detail
exports draw a progress bar on stderr when it is a terminal.
"""

from __future__ import annotations

import argparse
import sys
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import TextIO

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session

import tenants
from billing import (
    ExportFormat,
    ExportRequest,
    InvalidPeriodError,
    Period,
    count_records,
    export_lines,
)
from gateway.commands.tenants import database_session

# Lines written between two looks at the clock for the progress bar.
_PROGRESS_EVERY_LINES = 1000
_PROGRESS_BAR_WIDTH = 30


def register(subparsers: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    group = subparsers.add_parser("billing", help="usage exports")
    commands = group.add_subparsers(dest="billing_command", required=True)

    export = commands.add_parser(
        "export",
        help="export a month of usage (daily lines per tenant, or every record)",
        description="Daily lines per tenant (requests, tokens by kind, GPU-seconds, recompute"
        " charged, amount), or every usage record with --detail.",
    )
    export.add_argument("--period", required=True, type=_period, help="the month, YYYY-MM (UTC)")
    export.add_argument("--tenant", help="only this tenant (id or name)")
    export.add_argument(
        "--format", choices=[f.value for f in ExportFormat], default="csv", help="default: csv"
    )
    export.add_argument("--detail", action="store_true", help="every record, not daily lines")
    export.add_argument("--output", type=Path, help="write to this file (default: stdout)")
    export.add_argument(
        "--database-url",
        help=f"default: ${tenants.DATABASE_URL_ENV}, else {tenants.DEFAULT_DATABASE_URL}",
    )
    export.add_argument(
        "--no-migrate", action="store_true", help="do not run migrations (upgrade head) first"
    )
    export.set_defaults(func=_export)


def _period(text: str) -> Period:
    try:
        return Period.parse(text)
    except InvalidPeriodError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _export(args: argparse.Namespace) -> int:
    try:
        with database_session(args) as session:
            request = ExportRequest(
                period=args.period,
                format=ExportFormat(args.format),
                tenant_id=_tenant_id(session, args.tenant),
                is_detail=args.detail,
            )
            with _output(args.output) as out:
                _write(session, request, out)
    except tenants.TenantsError as exc:
        print(f"tiergate: error: {exc}", file=sys.stderr)
        return 1
    except SQLAlchemyError as exc:
        print(f"tiergate: database error: {exc.__class__.__name__}: {exc}", file=sys.stderr)
        return 1
    except OSError as exc:
        print(f"tiergate: cannot write {args.output}: {exc}", file=sys.stderr)
        return 1
    return 0


def _tenant_id(session: Session, ref: str | None) -> int | None:
    # An id is taken as given: the records of a deleted tenant can still be exported.
    if ref is None:
        return None
    if tenants.is_row_id(ref):
        return tenants.validate_row_id(ref, "--tenant")
    return tenants.find_tenant(session, ref).id


@contextmanager
def _output(path: Path | None) -> Iterator[TextIO]:
    """stdout, or path written in full or not at all (a partial file is renamed on success)."""
    if path is None:
        yield sys.stdout
        return
    partial = path.with_name(path.name + ".partial")
    try:
        with partial.open("w", encoding="utf-8", newline="") as out:
            yield out
        partial.replace(path)
    finally:
        partial.unlink(missing_ok=True)


def _write(session: Session, request: ExportRequest, out: TextIO) -> None:
    bar = None
    if request.is_detail and sys.stderr.isatty():
        bar = _ProgressBar(count_records(session, request.period, request.tenant_id), sys.stderr)
    # Records written so far: every line, less the CSV header.
    num_records = -1 if request.format is ExportFormat.CSV else 0
    for line in export_lines(session, request):
        out.write(line)
        num_records += 1
        if bar is not None and num_records % _PROGRESS_EVERY_LINES == 0:
            bar.show(num_records)
    if bar is not None:
        bar.finish(num_records)


class _ProgressBar:
    """``[#####.....]  50%  50,000/100,000 records`` on one terminal line, redrawn in place."""

    def __init__(self, num_total: int, stream: TextIO, *, min_interval_s: float = 0.1) -> None:
        self._num_total = num_total
        self._stream = stream
        self._min_interval_s = min_interval_s
        self._shown_at = 0.0

    def show(self, num_done: int) -> None:
        now = time.monotonic()
        if now - self._shown_at >= self._min_interval_s:
            self._shown_at = now
            self._draw(num_done)

    def finish(self, num_done: int) -> None:
        self._draw(num_done)
        self._stream.write("\n")
        self._stream.flush()

    def _draw(self, num_done: int) -> None:
        share = min(1.0, num_done / self._num_total) if self._num_total else 1.0
        filled = round(share * _PROGRESS_BAR_WIDTH)
        bar = "#" * filled + "." * (_PROGRESS_BAR_WIDTH - filled)
        self._stream.write(f"\r[{bar}] {share:4.0%}  {num_done:,}/{self._num_total:,} records")
        self._stream.flush()
