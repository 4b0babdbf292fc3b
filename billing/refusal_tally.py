"""Refusals folded into one usage record per key, model (and adapter) and endpoint a second.

A refusal used nothing, but it is still worth a line in the ledger (who was turned away, how
often). A record per refusal would let a client that sends 429s as fast as it can make the
ledger write as fast as it sends; folded, a flood costs one row a second per key, and a
refusal costs the gateway a dict update instead of a queued write.

What is folded lives in memory until the next flush (``interval_s``): a crash loses at most
that second of refusal counts, never a record of a request that ran.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from datetime import datetime

from billing.errors import InvalidSettingError
from billing.records import RecordStatus, UsageRecord

logger = logging.getLogger(__name__)

# What a record of refusals is kept apart by: everything but the times and the count.
_FoldKey = tuple[int, int | None, str, str | None, str, str]


@dataclass
class _Fold:
    first: UsageRecord
    num_requests: int
    finished_at: datetime


class RefusalTally:
    """Takes refused requests' records (``add``, synchronous) and hands the ledger one record
    per key, model, tier and endpoint every ``interval_s`` (``write``: the ledger's
    ``record``)."""

    def __init__(
        self,
        write: Callable[[UsageRecord], Awaitable[None]],
        *,
        interval_s: float = 1.0,
    ) -> None:
        if not interval_s > 0:
            raise InvalidSettingError("interval_s must be positive", "interval_s")
        self._write = write
        self._interval_s = interval_s
        self._folds: dict[_FoldKey, _Fold] = {}
        self._task: asyncio.Task[None] | None = None
        self._stopping = asyncio.Event()

    @property
    def num_pending(self) -> int:
        """Refusals folded since the last flush."""
        return sum(fold.num_requests for fold in self._folds.values())

    def add(self, record: UsageRecord) -> None:
        if record.status is not RecordStatus.REFUSED:
            raise ValueError("only refusals are folded")
        key = (record.tenant_id, record.api_key_id, record.model, record.adapter, record.tier,
               record.endpoint)
        fold = self._folds.get(key)
        if fold is None:
            self._folds[key] = _Fold(record, record.num_requests, record.finished_at)
        else:
            fold.num_requests += record.num_requests
            fold.finished_at = max(fold.finished_at, record.finished_at)

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.get_running_loop().create_task(self._run())

    async def flush(self) -> None:
        """Write what was folded since the last flush, as one group of ledger records."""
        folds, self._folds = self._folds, {}
        if not folds:
            return
        records = [
            dataclasses.replace(
                fold.first,
                request_id=f"refusals-{uuid.uuid4().hex}",
                num_requests=fold.num_requests,
                finished_at=fold.finished_at,
                e2e_time_s=None,
            )
            for fold in folds.values()
        ]
        results = await asyncio.gather(
            *(self._write(record) for record in records), return_exceptions=True
        )
        for record, result in zip(records, results, strict=True):
            if isinstance(result, BaseException):
                logger.error(
                    "a record of %d refusal(s) of tenant %d was lost: %s",
                    record.num_requests, record.tenant_id, result,
                )

    async def close(self) -> None:
        """Stop the periodic flush (one under way finishes) and write what is left."""
        self._stopping.set()
        if self._task is not None:
            await self._task
            self._task = None
        await self.flush()

    async def _run(self) -> None:
        while not self._stopping.is_set():
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._stopping.wait(), self._interval_s)
            await self.flush()
