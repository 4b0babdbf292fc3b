"""The local spool: an append-only JSON Lines file of records the database could not take.

Each append is one write of whole lines followed by fsync, so an appended batch is durable
before its callers are told so. A crash in the middle of an append can leave a torn last
line; that batch was never acknowledged, and ``recover`` ends the torn line so later appends
start on a line of their own. Lines that do not parse, and records the database refuses for
what they hold, are kept in ``<spool>.rejected`` (and logged) rather than dropped, for an
operator to look at.

Not thread-safe, and one file per process: the ledger serialises every call.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

from billing.errors import InvalidRecordError
from billing.records import UsageRecord

logger = logging.getLogger(__name__)


@dataclass(frozen=True)
class SpoolChunk:
    """Records read from the spool, from one offset up to the next."""

    records: list[UsageRecord]  # the complete, readable lines, in file order
    next_offset: int  # byte offset after the last line read
    rejected_lines: list[bytes]  # complete lines that are not records (see Spool.reject)
    is_end: bool  # True when next_offset is the end of the complete lines


class Spool:
    """An append-only file of usage records with fsync'd appends."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self.rejected_path = path.with_name(path.name + ".rejected")

    def recover(self) -> None:
        """Terminate a torn last line left by a crash (call once, before appending)."""
        if self.is_empty():
            return
        with self.path.open("rb+") as spool:
            spool.seek(-1, os.SEEK_END)
            if spool.read(1) != b"\n":
                logger.warning("spool %s ends with a torn line (a crash mid-append)", self.path)
                spool.write(b"\n")
                spool.flush()
                os.fsync(spool.fileno())

    def is_empty(self) -> bool:
        try:
            return self.path.stat().st_size == 0
        except FileNotFoundError:
            return True

    def append(self, records: Sequence[UsageRecord]) -> None:
        """Write records and fsync; raises OSError when the disk refuses."""
        data = memoryview(b"".join(_encode(record) for record in records))
        is_new = not self.path.exists()
        # Owner-only: the records say who used what.
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            size = os.fstat(fd).st_size
            try:
                while data:
                    data = data[os.write(fd, data) :]
                os.fsync(fd)
            except OSError:
                # A partial line would glue itself to the next append: cut it off again.
                with contextlib.suppress(OSError):
                    os.ftruncate(fd, size)
                raise
        finally:
            os.close(fd)
        if is_new:
            _sync_directory(self.path.parent)

    def read_chunk(self, offset: int, max_records: int) -> SpoolChunk:
        """Up to max_records complete lines starting at byte offset."""
        records: list[UsageRecord] = []
        rejected: list[bytes] = []
        try:
            spool = self.path.open("rb")
        except FileNotFoundError:
            return SpoolChunk([], offset, [], is_end=True)
        with spool:
            spool.seek(offset)
            is_end = False
            while len(records) + len(rejected) < max_records:
                line = spool.readline()
                if not line.endswith(b"\n"):  # end of file, or a torn line not yet recovered
                    is_end = True
                    break
                offset += len(line)
                if line.strip():
                    try:
                        records.append(UsageRecord.from_json(json.loads(line)))
                    except (ValueError, InvalidRecordError):
                        rejected.append(line)
            else:
                is_end = spool.read(1) == b""
        return SpoolChunk(records, offset, rejected, is_end)

    def truncate(self) -> None:
        """Empty the spool once everything in it is in the database."""
        with self.path.open("rb+") as spool:
            spool.truncate(0)
            os.fsync(spool.fileno())

    def reject(self, lines: Sequence[bytes], why: str = "unreadable") -> None:
        """Keep lines in the .rejected file (before the spool is truncated): unreadable ones,
        or records the database refuses for what they hold (why says which)."""
        if not lines:
            return
        logger.error(
            "spool %s: %d %s line(s) copied to %s",
            self.path,
            len(lines),
            why,
            self.rejected_path,
        )
        with self.rejected_path.open("ab") as rejected:
            rejected.write(b"".join(lines))
            rejected.flush()
            os.fsync(rejected.fileno())


def encode_record(record: UsageRecord) -> bytes:
    """A record's spool line."""
    return _encode(record)


def _encode(record: UsageRecord) -> bytes:
    return json.dumps(record.to_json(), separators=(",", ":")).encode() + b"\n"


def _sync_directory(directory: Path) -> None:
    # The new file's directory entry must reach the disk too, or a crash can lose the file.
    fd = os.open(directory, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
