"""The usage ledger: group commit, exactly once per request id, a spool while the database is down.

``await ledger.record(r)`` returns once r is durable: committed to the database, or appended
to the local spool file and fsync'd. One writer thread takes records off a queue and commits
them in batches (everything that arrives within ``flush_interval_s`` of the first, at most
``max_batch``), so many requests finishing together cost one transaction, and the event loop
never waits on the database except for the record it has asked to be made durable.

When a commit fails the database is marked unhealthy and that batch, and every batch after
it, goes to the spool. Every ``retry_interval_s`` the writer tries the database again by
replaying a chunk of the spool (or probing, when the spool is empty); once that works, new
batches go to the database again and the spool drains a chunk per turn, between batches.
Inserts skip request ids already stored, so replaying a spool twice, or a crash between a
replay's commit and the spool's truncation, never duplicates a record. A chunk the database
refuses for what a record holds (not for being away) is inserted record by record, and the
refused ones are set aside in ``<spool>.rejected``: one bad record cannot hold up the rest.

The writer never waits on the database longer than ``call_timeout_s`` (``probe_timeout_s``
for the probe that asks whether an unhealthy database is back): each database call runs on a
thread of its own, and one that outlives its deadline (a database that accepts connections
and never answers: SIGSTOPped, partitioned, a lock past the server's own limits) is left to
finish there while its batch goes to the spool, exactly as for a refused connection. An
insert that returns after its deadline rolls back instead of committing (the spool has its
records, or its waiters were told they were not written); only one held up inside its
commit may still land, and the spool's replay then skips its records. While
MAX_STUCK_CALLS such calls are still running, the database is not called at all.

What a previous process left in the spool is replayed the same way, a chunk per turn of
the writer after it starts, so a large spool neither delays the start nor holds the records
of the new process behind it; a tenant's monthly total that needs the spool in the database
first waits for it chunk by chunk, the writes queued meanwhile going first.

``close()`` (the SIGTERM path) writes everything queued, then tries to empty the spool.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import queue
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import TypeVar

from sqlalchemy import select
from sqlalchemy.exc import DataError, IntegrityError, SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

from billing.errors import (
    InvalidSettingError,
    LedgerClosedError,
    LedgerUnavailableError,
    LedgerWriteError,
)
from billing.models import USAGE_RECORDS
from billing.monthly import MonthlyTotals, MonthlyUsage
from billing.period import Period
from billing.records import UsageRecord
from billing.rollups import UsageTotals, interval_totals, key_interval_totals
from billing.spool import Spool, encode_record
from billing.store import insert_records
from tenants import CallTimedOut, DeadlineCall, DeadlineCalls

logger = logging.getLogger(__name__)

_T = TypeVar("_T")

# Called from the writer thread with None (done) or the error to raise in the waiter.
_Settle = Callable[[BaseException | None], None]

# Database calls past their deadline that may still be running before the writer stops
# calling the database (until one of them returns).
MAX_STUCK_CALLS = 2


class DatabaseCallTimeout(SQLAlchemyError):
    """A database call of the ledger got no answer within its deadline: handled as the
    database being away (the batch spooled, retried later)."""


@dataclass(frozen=True)
class ReplayReport:
    """What one replay of the spool did."""

    num_read: int  # records read from the spool
    num_inserted: int  # of those, not already in the database
    num_rejected: int  # unreadable lines, and records the database refused, set aside

    def __add__(self, other: ReplayReport) -> ReplayReport:
        return ReplayReport(
            self.num_read + other.num_read,
            self.num_inserted + other.num_inserted,
            self.num_rejected + other.num_rejected,
        )


@dataclass(frozen=True)
class _Write:
    record: UsageRecord
    settle: _Settle


@dataclass(frozen=True)
class _Load:
    tenant_id: int  # whose total to load; ignored when api_key_id is set
    period: Period
    settle: _Settle
    api_key_id: int | None = None  # an API key's own total instead of its tenant's


class _Stop:
    pass


_Item = _Write | _Load | _Stop


class UsageLedger:
    """Writes usage records durably and keeps this month's totals per tenant."""

    def __init__(
        self,
        session_factory: sessionmaker[Session],
        spool_path: Path | str,
        *,
        flush_interval_s: float = 0.005,
        max_batch: int = 500,
        retry_interval_s: float = 1.0,
        call_timeout_s: float = 2.0,
        probe_timeout_s: float = 0.5,
        clock: Callable[[], datetime] = lambda: datetime.now(UTC),
    ) -> None:
        if not flush_interval_s >= 0:
            raise InvalidSettingError("flush_interval_s must not be negative", "flush_interval_s")
        if max_batch < 1:
            raise InvalidSettingError("max_batch must be at least 1", "max_batch")
        if not retry_interval_s > 0:
            raise InvalidSettingError("retry_interval_s must be positive", "retry_interval_s")
        for name, value in (("call_timeout_s", call_timeout_s),
                            ("probe_timeout_s", probe_timeout_s)):
            if not value > 0:
                raise InvalidSettingError(f"{name} must be positive", name)
        self._session_factory = session_factory
        self._spool = Spool(Path(spool_path))
        self._flush_interval_s = flush_interval_s
        self._max_batch = max_batch
        self._retry_interval_s = retry_interval_s
        self._call_timeout_s = call_timeout_s
        self._probe_timeout_s = probe_timeout_s
        self._db_calls = DeadlineCalls("usage-ledger-db", MAX_STUCK_CALLS)
        self._clock = clock  # wall clock: which month monthly_usage() means
        self._queue: queue.SimpleQueue[_Item] = queue.SimpleQueue()
        # Held while checking is_accepting and queueing, so nothing is queued after _Stop.
        self._accept_lock = threading.Lock()
        self._is_accepting = False
        self._thread: threading.Thread | None = None
        # One user of the database and spool at a time: the writer, or replay_spool().
        self._io_lock = threading.Lock()
        self._is_database_healthy = True
        self._spool_has_records = False
        self._replay_offset = 0  # bytes of the spool already replayed since its last truncation
        self._retry_at_s = 0.0  # time.monotonic() of the next try while unhealthy
        self._totals = MonthlyTotals()

    @property
    def spool_path(self) -> Path:
        return self._spool.path

    @property
    def spool_bytes(self) -> int:
        """The spool's size: records waiting for the database (0 when there is none)."""
        try:
            return self._spool.path.stat().st_size
        except FileNotFoundError:
            return 0

    @property
    def is_database_healthy(self) -> bool:
        """False from a failed commit until the database answers again."""
        return self._is_database_healthy

    async def start(self) -> None:
        """Start the writer thread; it replays what a previous process left in the spool a
        chunk at a time, between batches."""
        if self._thread is not None:
            return
        await asyncio.to_thread(self._prepare)
        self._thread = threading.Thread(target=self._run, name="usage-ledger", daemon=True)
        self._thread.start()
        with self._accept_lock:
            self._is_accepting = True

    async def record(self, record: UsageRecord) -> None:
        """Return once record is committed or spooled; raises LedgerWriteError if neither."""
        await self._submit(lambda settle: _Write(record, settle))

    async def monthly_usage(self, tenant_id: int) -> MonthlyUsage:
        """The tenant's running total for the current UTC month.

        From memory after the first call of the month, which reads the database (and raises
        LedgerUnavailableError while it is down).
        """
        period = Period.containing(self._clock())
        while (usage := self._totals.get(tenant_id, period)) is None:
            await self._submit(lambda settle: _Load(tenant_id, period, settle))
        return usage

    async def key_monthly_usage(self, api_key_id: int) -> MonthlyUsage:
        """An API key's own running total for the current UTC month (its records' tokens and
        charges), loaded and kept as monthly_usage's."""
        period = Period.containing(self._clock())
        while (usage := self._totals.get_key(api_key_id, period)) is None:
            await self._submit(lambda settle: _Load(0, period, settle, api_key_id))
        return usage

    async def close(self) -> None:
        """Write everything queued, try to empty the spool, stop the writer."""
        with self._accept_lock:
            if not self._is_accepting:
                return
            self._is_accepting = False
            self._queue.put(_Stop())
        assert self._thread is not None
        await asyncio.to_thread(self._thread.join)
        self._thread = None

    def replay_spool(self) -> ReplayReport:
        """Insert everything in the spool, skipping records already stored, then empty it.

        Blocking: call it off the event loop. Raises LedgerUnavailableError while the
        database is down (the spool is kept).
        """
        with self._io_lock:
            self._spool_has_records = not self._spool.is_empty()
            try:
                report = self._replay_all()
            except SQLAlchemyError as exc:
                self._mark_down(exc)
                raise LedgerUnavailableError(f"cannot replay the spool: {exc}") from exc
        self._mark_up()
        return report

    # --- caller side ---------------------------------------------------------------------

    async def _submit(self, make_item: Callable[[_Settle], _Item]) -> None:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[None] = loop.create_future()
        with self._accept_lock:
            if not self._is_accepting:
                raise LedgerClosedError("the usage ledger is not running")
            self._queue.put(make_item(_settler(loop, future)))
        await future

    # --- writer thread -------------------------------------------------------------------

    def _prepare(self) -> None:
        with self._io_lock:
            self._spool.recover()
            self._replay_offset = 0
            self._spool_has_records = not self._spool.is_empty()
        if self._spool_has_records:
            logger.info("usage ledger: %s holds %d bytes of records from an earlier run: "
                        "replaying them a chunk at a time", self._spool.path, self.spool_bytes)
        try:
            with self._io_lock:
                self._probe()
            self._mark_up()
        except SQLAlchemyError as exc:
            self._mark_down(exc)  # records spool until the database is back

    def _run(self) -> None:
        is_stopping = False
        while not is_stopping:
            items = self._next_items()
            is_stopping = any(isinstance(item, _Stop) for item in items)
            self._handle(items, may_defer=not is_stopping)
            if not is_stopping:
                self._retry_if_due()
        self._finish()

    def _next_items(self) -> list[_Item]:
        """Block for the first item, then gather writes for up to flush_interval_s."""
        timeout = None
        if not self._is_database_healthy or self._spool_has_records:
            timeout = max(0.0, self._retry_at_s - time.monotonic())
        try:
            items = [self._queue.get(timeout=timeout)]
        except queue.Empty:
            return []
        num_writes = int(isinstance(items[0], _Write))
        deadline = time.monotonic() + self._flush_interval_s
        while num_writes and num_writes < self._max_batch and not isinstance(items[-1], _Stop):
            try:
                items.append(self._queue.get(timeout=max(0.0, deadline - time.monotonic())))
            except queue.Empty:
                break
            num_writes += isinstance(items[-1], _Write)
        return items

    def _handle(self, items: Sequence[_Item], may_defer: bool = False) -> None:
        """may_defer: a load that needs the spool replayed first replays one chunk and goes
        back in the queue, behind the writes that came meanwhile."""
        writes = [item for item in items if isinstance(item, _Write)]
        if writes:
            self._write(writes)
        for item in items:
            if isinstance(item, _Load):
                self._load(item, may_defer)

    def _write(self, writes: Sequence[_Write]) -> None:
        error: BaseException | None = None
        try:
            with self._io_lock:
                counted = self._make_durable([write.record for write in writes])
            self._totals.add(counted)
        except LedgerWriteError as exc:
            error = exc
        except Exception as exc:  # a bug: keep the writer alive and tell every waiter
            logger.exception("usage ledger: unexpected error writing a batch")
            error = LedgerWriteError(f"internal error writing usage records: {exc!r}")
        for write in writes:
            write.settle(error)

    def _make_durable(self, records: list[UsageRecord]) -> list[UsageRecord]:
        """Commit, or else spool, records; return those to count in the monthly totals."""
        if self._is_database_healthy:
            try:
                inserted = self._insert(records)
            except SQLAlchemyError as exc:
                self._mark_down(exc)
            else:
                # Already-stored ids (a caller recording twice) must not count twice.
                counted = []
                for record in records:
                    if record.request_id in inserted:
                        inserted.discard(record.request_id)
                        counted.append(record)
                return counted
        try:
            self._spool.append(records)
        except OSError as exc:
            logger.error("usage ledger: cannot write the spool %s: %s", self._spool.path, exc)
            raise LedgerWriteError(
                f"database unavailable and spool {self._spool.path} not writable: {exc}"
            ) from exc
        self._spool_has_records = True
        return records

    def _load(self, load: _Load, may_defer: bool) -> None:
        if load.api_key_id is not None:
            is_loaded = self._totals.get_key(load.api_key_id, load.period) is not None
        else:
            is_loaded = self._totals.get(load.tenant_id, load.period) is not None
        if not is_loaded:
            try:
                with self._io_lock:
                    # The spool first, so the database sum includes what only the spool holds.
                    if self._spool_has_records and may_defer:
                        self._replay_step(self._max_batch)
                        if self._spool_has_records:
                            self._queue.put(load)  # after the writes queued meanwhile
                            return
                    if self._spool_has_records:
                        self._replay_all()
                    totals = self._call(
                        lambda _abandoned: self._interval_totals(load), self._call_timeout_s
                    )
            except SQLAlchemyError as exc:
                self._mark_down(exc)
                load.settle(LedgerUnavailableError(f"cannot read monthly usage: {exc}"))
                return
            except OSError as exc:
                load.settle(LedgerUnavailableError(f"cannot empty the spool: {exc}"))
                return
            self._mark_up()
            usage = MonthlyUsage(
                totals.num_prompt_tokens + totals.num_completion_tokens, totals.amount_usd_micros
            )
            if load.api_key_id is not None:
                self._totals.set_key_loaded(load.api_key_id, load.period, usage)
            else:
                self._totals.set_loaded(load.tenant_id, load.period, usage)
        load.settle(None)

    def _retry_if_due(self) -> None:
        if self._is_database_healthy and not self._spool_has_records:
            return
        if time.monotonic() < self._retry_at_s:
            return
        try:
            with self._io_lock:
                if not self._is_database_healthy:
                    self._probe()  # quick to fail: the writer is not held by a dead database
                if self._spool_has_records:
                    self._replay_step(self._max_batch)
        except SQLAlchemyError as exc:
            self._mark_down(exc)
        except OSError as exc:  # the spool stays; replaying it again later is harmless
            logger.error("usage ledger: cannot replay the spool %s: %s", self._spool.path, exc)
            self._retry_at_s = time.monotonic() + self._retry_interval_s
        else:
            self._mark_up()

    def _finish(self) -> None:
        """After _Stop: nothing more is queued; write what is, then try to empty the spool."""
        leftovers: list[_Item] = []
        while True:
            try:
                leftovers.append(self._queue.get_nowait())
            except queue.Empty:
                break
        self._handle(leftovers)
        if self._spool_has_records:
            try:
                report = self.replay_spool()
                logger.info("usage ledger: replayed %s at shutdown", report)
            except LedgerUnavailableError:
                logger.warning(
                    "usage ledger: %s keeps records for the next start", self._spool.path
                )
            except OSError as exc:
                logger.error("usage ledger: cannot replay %s: %s", self._spool.path, exc)

    # --- database and spool (hold _io_lock) ------------------------------------------------

    def _insert(self, records: Sequence[UsageRecord]) -> set[str]:
        def insert(abandoned: threading.Event) -> set[str]:
            with self._session_factory() as session:
                inserted = insert_records(session, records)
                if abandoned.is_set():  # the writer has spooled them, or given up on them
                    session.rollback()
                    return set()
                session.commit()
                return inserted

        return self._call(insert, self._call_timeout_s)

    def _probe(self) -> None:
        def probe(_abandoned: threading.Event) -> None:
            with self._session_factory() as session:
                session.execute(select(USAGE_RECORDS.c.request_id).limit(1))

        self._call(probe, self._probe_timeout_s)

    def _call(self, call: DeadlineCall[_T], timeout_s: float) -> _T:
        """call(abandoned) within timeout_s (tenants.DeadlineCalls), its timeout an outage."""
        try:
            return self._db_calls.call(call, timeout_s)
        except CallTimedOut as exc:
            raise DatabaseCallTimeout(str(exc)) from None

    def _interval_totals(self, load: _Load) -> UsageTotals:
        with self._session_factory() as session:
            if load.api_key_id is not None:
                return key_interval_totals(
                    session, load.period.start, load.period.end, load.api_key_id)
            return interval_totals(session, load.period.start, load.period.end, load.tenant_id)

    def _replay_all(self) -> ReplayReport:
        report = ReplayReport(0, 0, 0)
        while self._spool_has_records:
            report += self._replay_step(self._max_batch)
        return report

    def _replay_step(self, max_records: int) -> ReplayReport:
        chunk = self._spool.read_chunk(self._replay_offset, max_records)
        refused: list[UsageRecord] = []
        try:
            num_inserted = len(self._insert(chunk.records)) if chunk.records else 0
        except (DataError, IntegrityError):
            # Some record the database refuses for what it holds (a value out of a column's
            # range, a check): one by one, so the others go in and it alone is set aside,
            # instead of the chunk failing every replay for ever.
            num_inserted, refused = self._insert_each(chunk.records)
        self._spool.reject(chunk.rejected_lines)
        self._spool.reject([encode_record(r) for r in refused], why="refused by the database")
        self._replay_offset = chunk.next_offset
        if chunk.is_end:
            self._spool.truncate()
            self._replay_offset = 0
            self._spool_has_records = False
        return ReplayReport(
            len(chunk.records), num_inserted, len(chunk.rejected_lines) + len(refused)
        )

    def _insert_each(self, records: Sequence[UsageRecord]) -> tuple[int, list[UsageRecord]]:
        """Insert records one transaction each: how many were new, and those refused for
        their content (an outage still raises)."""
        num_inserted, refused = 0, []
        for record in records:
            try:
                num_inserted += len(self._insert([record]))
            except (DataError, IntegrityError):
                refused.append(record)
        return num_inserted, refused

    # --- health ----------------------------------------------------------------------------

    def _mark_down(self, exc: Exception) -> None:
        if self._is_database_healthy:
            logger.warning(
                "usage ledger: database unavailable, spooling to %s: %s", self._spool.path, exc
            )
        self._is_database_healthy = False
        self._retry_at_s = time.monotonic() + self._retry_interval_s

    def _mark_up(self) -> None:
        if not self._is_database_healthy:
            logger.info("usage ledger: database reachable again")
        self._is_database_healthy = True


def _settler(loop: asyncio.AbstractEventLoop, future: asyncio.Future[None]) -> _Settle:
    def settle(error: BaseException | None) -> None:
        # RuntimeError: the loop is closed, so nobody waits any more; the write stands.
        with contextlib.suppress(RuntimeError):
            loop.call_soon_threadsafe(_resolve, future, error)

    return settle


def _resolve(future: asyncio.Future[None], error: BaseException | None) -> None:
    if future.done():  # the waiter was cancelled (client gone); the record is written anyway
        return
    if error is None:
        future.set_result(None)
    else:
        future.set_exception(error)
