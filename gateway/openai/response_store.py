"""Where the Responses API keeps responses sent with `store` (the default): the database all
replicas share, per tenant, for the retention the deployment sets
(--response-retention-days; 0 keeps none). A response is written before its client sees it
end, so a client that saw it can at once retrieve it or continue from it on any replica.
Responses past their retention are never returned, and are deleted a batch at a time, at
most once every PURGE_INTERVAL_S per replica, by the next write.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any, TypeVar

from sqlalchemy.exc import SQLAlchemyError
from sqlalchemy.orm import Session, sessionmaker

import tenants
from gateway.http.errors import ServiceUnavailableError
from gateway.server.db_work import detached, in_transaction

logger = logging.getLogger(__name__)

T = TypeVar("T")

PURGE_INTERVAL_S = 3600.0


class ResponseStore:
    def __init__(self, session_factory: sessionmaker[Session], retention_days: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self._session_factory = session_factory
        self._retention = timedelta(days=retention_days)
        self._clock = clock
        self._next_purge = clock()

    @property
    def keeps_responses(self) -> bool:
        return self._retention > timedelta(0)

    async def find(self, tenant_id: int, response_id: str) -> tenants.StoredResponse | None:
        """The tenant's stored response (another tenant's, or an expired one: None)."""
        now = datetime.now(UTC)

        return await self._in_session(lambda session: detached(
            session, tenants.find_response(session, tenant_id, response_id, now)))

    async def save(self, tenant_id: int, body: dict[str, Any],
                   conversation: list[dict[str, Any]]) -> None:
        """Keep a finished response and the conversation it ends."""
        now = datetime.now(UTC)
        purge = self._clock() >= self._next_purge
        if purge:
            self._next_purge = self._clock() + PURGE_INTERVAL_S

        def write(session: Session) -> None:
            tenants.save_response(session, tenants.StoredResponse(
                id=body["id"], tenant_id=tenant_id, model=body["model"],
                previous_response_id=body.get("previous_response_id"), created_at=now,
                expires_at=now + self._retention, body=body, conversation=conversation,
            ))
            if purge:
                tenants.purge_expired_responses(session, now)

        await self._in_session(write)

    async def delete(self, tenant_id: int, response_id: str) -> bool:
        return await self._in_session(
            lambda session: tenants.delete_response(session, tenant_id, response_id))

    async def _in_session(self, work: Callable[[Session], T]) -> T:
        try:
            return await in_transaction(self._session_factory, work)
        except SQLAlchemyError as exc:
            logger.error("the response store failed: %s", type(exc).__name__)
            raise ServiceUnavailableError(
                "stored responses are unavailable (the database did not answer); retry later",
                code="response_store_unavailable",
            ) from None
