"""Each replica's batch runner: claims lines of running batches from the database, runs each
as the request it holds (in the batch tier, under the limits and budgets of the key that
created the batch), stores its result, and writes a batch's output and error files once its
lines are done.

- Capacity: lines run in the batch tier, from idle capacity: while no request of a more
  important tier runs, waits or arrived lately in an engine of the replica, up to
  --batch-max-in-flight lines at once; otherwise no more than --batch-floor-in-flight (the
  floor that keeps a batch from starving), so the steps interactive requests share hold few
  batch sequences. The
  engine's tiered policy serves premium and standard first and preempts batch work for
  them.
- Takeover: a claim is a lease (LEASE_S), renewed while its line runs; the lines of a replica
  that died are claimed by another once their leases lapse. A result is stored only under the
  claim that ran it, so each line has one result, and each line's request id is its own on
  every replica, so the ledger keeps one record of a line run twice.
- Refusals: a line refused for the moment (rate limits, SLO shedding) goes back to pending
  until its retry-after; a line refused by a budget (the tenant's or the key's) stops the
  batch: it and every line not run yet end with that error, and the batch fails.
- Server errors are retried (MAX_ATTEMPTS in all) before they become the line's error.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import functools
import io
import json
import logging
import secrets
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy.orm import Session
from starlette.concurrency import run_in_threadpool

import tenants
from gateway.access.admission import AdmissionRefusal
from gateway.access.auth import TenantPrincipal
from gateway.files.storage import FileStorage
from gateway.http.errors import GatewayError, error_body
from gateway.openai.requests import Endpoint
from gateway.openai.routes import OpenAIApi
from gateway.server.db_work import detached, in_transaction
from gateway.server.runtime import GatewayRuntime
from policies import AbovePlan, RefusalReason, served_tier

logger = logging.getLogger(__name__)

T = TypeVar("T")

LEASE_S = 30.0
POLL_S = 0.5
FINALIZE_EVERY_S = 1.0
MAX_ATTEMPTS = 3
RETRY_BACKOFF_S = 2.0
PRINCIPAL_TTL_S = 30.0
_ENDPOINTS = {"/v1/chat/completions": Endpoint.CHAT, "/v1/completions": Endpoint.COMPLETIONS,
              "/v1/responses": Endpoint.RESPONSES}
_BUDGET_REASONS = (RefusalReason.BUDGET, RefusalReason.KEY_BUDGET)
LINE_DONE = "done"  # tenants.batches' status of a line with its result


def line_id_prefix(batch_id: str) -> str:
    return f"batch_req_{batch_id.removeprefix('batch_')}_"


def line_request_id(batch_id: str, line_index: int) -> str:
    """A line's request id: its own, the same on every replica that runs it."""
    return f"{line_id_prefix(batch_id)}{line_index}"


class BatchRunner:
    def __init__(self, runtime: GatewayRuntime, api: OpenAIApi, storage: FileStorage, *,
                 max_in_flight: int, floor_in_flight: int = 1, lease_s: float = LEASE_S,
                 poll_s: float = POLL_S,
                 count_lines: Callable[[str, str, int], None] = lambda _tier, _status, _n: None
                 ) -> None:
        """count_lines(tier, status, n): n lines of the batch tier ended (or were given back)
        here with status (the tiergate_batch_lines metric)."""
        self.runtime = runtime
        self._count_lines = count_lines
        self.api = api
        self.storage = storage
        self.max_in_flight = max_in_flight
        self.floor_in_flight = min(floor_in_flight, max_in_flight)
        flex = runtime.tiers.by_service_tier("flex")
        batch_tier = flex if flex is not None else max(runtime.tiers, key=lambda t: t.priority)
        self._batch_tier = batch_tier.name
        # Requests of tiers above this priority take the capacity first.
        self._batch_priority = batch_tier.priority
        self.lease_s = lease_s
        self.poll_s = poll_s
        self.replica = f"replica-{secrets.token_hex(8)}"
        self._running: dict[tuple[str, int], asyncio.Task[None]] = {}
        self._principals: dict[int, tuple[float, TenantPrincipal | GatewayError]] = {}
        self._task: asyncio.Task[None] | None = None
        self._wake = asyncio.Event()
        self._last_renewal = self._last_finalize = 0.0

    async def start(self) -> None:
        self._task = asyncio.create_task(self._loop(), name="batch-runner")

    async def close(self) -> None:
        """Stop claiming; lines still running are given back for another replica."""
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
        running = list(self._running.items())
        for _, task in running:
            task.cancel()
        await asyncio.gather(*(task for _, task in running), return_exceptions=True)
        now = datetime.now(UTC)

        def give_back(session: Session) -> None:
            for batch_id, line_index in (key for key, _ in running):
                tenants.release_line(session, self.replica, batch_id, line_index, now,
                                     failed_attempt=False)

        with contextlib.suppress(Exception):
            await self._in_session(give_back)

    async def _loop(self) -> None:
        loop = asyncio.get_running_loop()
        while True:
            try:
                now = loop.time()
                if self._running and now - self._last_renewal > self.lease_s / 3:
                    self._last_renewal = now
                    await self._renew()
                if not self.runtime.is_draining and self.runtime.is_model_loaded:
                    await self._claim()
                if now - self._last_finalize > FINALIZE_EVERY_S:
                    self._last_finalize = now
                    await self._finalize()
            except Exception as exc:  # the database away: try again next time
                logger.warning("batch runner: %s", type(exc).__name__)
            self._wake.clear()
            with contextlib.suppress(TimeoutError):
                await asyncio.wait_for(self._wake.wait(), self.poll_s)

    # -- lines -----------------------------------------------------------------------------------

    def _count(self, status: str, num_lines: int) -> None:
        self._count_lines(self._batch_tier, status, num_lines)

    def _interactive_work(self) -> bool:
        """Whether requests of a tier above the batch tier run, wait or arrived lately (the
        engine's arrival window, seconds) in an engine of this replica."""
        for name in self.runtime.models:
            stats = self.runtime.engine_stats(name)
            for tier in stats.tiers.values():
                if tier.priority < self._batch_priority and (tier.num_running
                                                             or tier.num_waiting):
                    return True
            for priority, arrivals in stats.arrivals.items():
                if priority < self._batch_priority and arrivals.requests_per_s > 0:
                    return True
        return False

    async def _claim(self) -> None:
        allowed = self.floor_in_flight if self._interactive_work() else self.max_in_flight
        room = allowed - len(self._running)
        if room <= 0:
            return
        now = datetime.now(UTC)
        lease_until = now + timedelta(seconds=self.lease_s)
        claimed = await self._in_session(
            lambda s: tenants.claim_lines(s, self.replica, now, lease_until, room))
        for line in claimed:
            key = (line.batch_id, line.line_index)
            task = asyncio.create_task(self._run_line(line), name=f"batch-line-{key}")
            self._running[key] = task
            task.add_done_callback(functools.partial(self._line_done, key))

    def _line_done(self, key: tuple[str, int], _task: asyncio.Task[None]) -> None:
        self._running.pop(key, None)
        self._wake.set()

    async def _renew(self) -> None:
        until = datetime.now(UTC) + timedelta(seconds=self.lease_s)
        keys = list(self._running)
        await self._in_session(lambda s: tenants.renew_claims(s, self.replica, keys, until))

    async def _run_line(self, line: tenants.ClaimedLine) -> None:
        request_id = line_request_id(line.batch_id, line.line_index)
        try:
            principal = await self._principal(line)
            status, body = await self.api.run_batch_line(
                principal, _ENDPOINTS[line.endpoint], json.dumps(line.body).encode(),
                request_id)
        except AdmissionRefusal as refusal:
            if refusal.reason in _BUDGET_REASONS:
                await self._stop_for_budget(line, request_id, refusal)
            else:
                await self._release(line, refusal.retry_after_s or RETRY_BACKOFF_S,
                                    failed_attempt=False)
                self._count("retried", 1)
            return
        except GatewayError as error:  # its key revoked, expired or its tenant disabled
            status, body = error.status_code, error.body()
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            logger.error("batch line %s failed: %s", request_id, type(exc).__name__)
            status, body = 500, error_body("the batch line could not be run", "server_error")
        if status >= 500 and line.attempts + 1 < MAX_ATTEMPTS:
            await self._release(line, RETRY_BACKOFF_S, failed_attempt=True)
            self._count("retried", 1)
            return
        result = {"id": request_id, "custom_id": line.custom_id,
                  "response": {"status_code": status, "request_id": request_id, "body": body},
                  "error": None}
        if await self._in_session(lambda s: tenants.finish_line(
                s, self.replica, line.batch_id, line.line_index, result,
                is_error=status != 200)):
            self._count("completed" if status == 200 else "failed", 1)

    async def _release(self, line: tenants.ClaimedLine, delay_s: float, *,
                       failed_attempt: bool) -> None:
        not_before = datetime.now(UTC) + timedelta(seconds=delay_s)
        await self._in_session(lambda s: tenants.release_line(
            s, self.replica, line.batch_id, line.line_index, not_before,
            failed_attempt=failed_attempt))

    async def _stop_for_budget(self, line: tenants.ClaimedLine, request_id: str,
                               refusal: AdmissionRefusal) -> None:
        """The line ends with the budget's refusal, the lines not run yet with a
        budget_exceeded error, and the batch will fail (no request runs past the budget)."""
        error = {"code": "budget_exceeded", "message": refusal.message}
        result = {"id": request_id, "custom_id": line.custom_id,
                  "response": {"status_code": refusal.status_code, "request_id": request_id,
                               "body": refusal.body()}, "error": None}

        def stop(session: Session) -> int:
            tenants.finish_line(session, self.replica, line.batch_id, line.line_index, result,
                                is_error=True)
            batch = session.get(tenants.Batch, line.batch_id)
            if batch is not None and not batch.errors:
                batch.errors = [{**error, "line": line.line_index + 1, "param": None}]
            return 1 + tenants.end_pending_lines(session, line.batch_id, status=LINE_DONE,
                                                 error=error,
                                                 id_prefix=line_id_prefix(line.batch_id))

        self._count("budget_stopped", await self._in_session(stop))

    async def _principal(self, line: tenants.ClaimedLine) -> TenantPrincipal:
        """The principal of the batch's key, in the batch tier (reloaded every
        PRINCIPAL_TTL_S: a key revoked meanwhile stops the lines still to run)."""
        if line.api_key_id is None:
            raise GatewayError("the batch's API key no longer exists")
        now = asyncio.get_running_loop().time()
        cached = self._principals.get(line.api_key_id)
        if cached is None or now - cached[0] > PRINCIPAL_TTL_S:
            try:
                found: TenantPrincipal | GatewayError = await run_in_threadpool(
                    self.runtime.key_resolver.principal_of_key, line.api_key_id)
            except GatewayError as error:
                found = error
            cached = (now, found)
            self._principals[line.api_key_id] = cached
        principal = cached[1]
        if isinstance(principal, GatewayError):
            raise principal
        tier = served_tier(self.runtime.tiers, principal.tier, "flex", AbovePlan.DOWNGRADE)
        return dataclasses.replace(principal, tier=tier.name)

    # -- batches ---------------------------------------------------------------------------------

    async def _finalize(self) -> None:
        """End what should end: lines of expired or budget-stopped batches not run yet; then
        every batch whose lines are all done gets its files and its final status."""
        now = datetime.now(UTC)
        stale = now - timedelta(seconds=self.lease_s)

        ended = {"expired": 0, "budget_stopped": 0}

        def due(session: Session) -> list[str]:
            ready = []
            for batch in tenants.batches_in(session, (*tenants.ACTIVE_BATCH_STATUSES,
                                                      "finalizing")):
                if batch.status == "finalizing":
                    if batch.finalizing_at is not None and batch.finalizing_at < stale:
                        ready.append(batch.id)  # its finalizer died: take it over
                    continue
                prefix = line_id_prefix(batch.id)
                if batch.status == "in_progress" and now >= batch.expires_at:
                    ended["expired"] += tenants.end_pending_lines(
                        session, batch.id, status=LINE_DONE, id_prefix=prefix, error={
                            "code": "batch_expired",
                            "message": "the batch's completion window ended before this "
                                       "request ran"})
                elif batch.status == "in_progress" and batch.errors:
                    ended["budget_stopped"] += tenants.end_pending_lines(
                        session, batch.id, status=LINE_DONE, id_prefix=prefix, error={
                            "code": "budget_exceeded", "message": batch.errors[0]["message"]})
                if not tenants.has_unfinished_lines(session, batch.id):
                    ready.append(batch.id)
            return ready

        ready = await self._in_session(due)
        for status, count in ended.items():
            if count:
                self._count(status, count)
        for batch_id in ready:
            if await self._in_session(functools.partial(
                    tenants.start_finalizing, batch_id=batch_id, now=now, stale_before=stale)):
                await self._write_files(batch_id)

    async def _write_files(self, batch_id: str) -> None:
        batch, outputs, errors = await self._in_session(lambda s: (
            detached(s, s.get(tenants.Batch, batch_id)),
            tenants.result_lines(s, batch_id, errors=False),
            tenants.result_lines(s, batch_id, errors=True)))
        if batch is None:
            return
        output_file = await self._store_file(batch, "batch_output", outputs)
        error_file = await self._store_file(batch, "batch_output", errors, suffix="errors")
        now = datetime.now(UTC)
        if batch.cancelling_at is not None:
            final = "cancelled"
        elif batch.errors:
            final = "failed"
        elif now >= batch.expires_at:
            final = "expired"
        else:
            final = "completed"

        files = [row for row in (output_file, error_file) if row is not None]

        def finish(session: Session) -> bool:
            if not tenants.set_batch_status(
                    session, batch_id, ("finalizing",), final, now,
                    output_file_id=None if output_file is None else output_file.id,
                    error_file_id=None if error_file is None else error_file.id):
                return False  # another finalizer was first
            session.add_all(files)
            return True

        if not await self._in_session(finish):
            for row in files:
                await run_in_threadpool(self.storage.delete, f"{row.tenant_id}/{row.id}")
            return
        logger.info("batch %s %s: %d outputs, %d errors", batch_id, final, len(outputs),
                    len(errors))

    async def _store_file(self, batch: tenants.Batch, purpose: str,
                          lines: list[dict[str, Any]], suffix: str = "output"
                          ) -> tenants.StoredFile | None:
        if not lines:
            return None
        content = b"".join(json.dumps(line, separators=(",", ":")).encode() + b"\n"
                           for line in lines)
        row = tenants.StoredFile(
            id=f"file-{secrets.token_hex(12)}", tenant_id=batch.tenant_id,
            filename=f"{batch.id}_{suffix}.jsonl", purpose=purpose, bytes=len(content),
            num_lines=len(lines), created_at=datetime.now(UTC))
        await run_in_threadpool(self.storage.put, f"{row.tenant_id}/{row.id}",
                                io.BytesIO(content))
        return row

    async def _in_session(self, work: Callable[[Session], T]) -> T:
        return await in_transaction(self.runtime.session_factory, work)
