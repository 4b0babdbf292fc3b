"""Database work from the event loop: one transaction in a worker thread, and rows taken out
of their session so that they can be read once it has ended."""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from sqlalchemy.orm import Session, sessionmaker
from starlette.concurrency import run_in_threadpool

T = TypeVar("T")


async def in_transaction(session_factory: sessionmaker[Session],
                         work: Callable[[Session], T]) -> T:
    """work(session) in one transaction (committed when it returns) in a worker thread."""
    def run() -> T:
        with session_factory.begin() as session:
            return work(session)

    return await run_in_threadpool(run)


def detached(session: Session, row: T | None) -> T | None:
    """row, no longer tied to session (its loaded columns stay readable)."""
    if row is not None:
        session.expunge(row)
    return row
