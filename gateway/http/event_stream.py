"""Server-sent events: the response that streams them to a client that must keep reading
(EventStream), and one JSON body as an event (sse_data, or sse_event with its type named)."""

from __future__ import annotations

import json
import logging
from collections.abc import AsyncGenerator, Mapping
from typing import Any

import anyio
from starlette.responses import StreamingResponse
from starlette.types import Message, Receive, Scope, Send

from gateway.http.protocol import abort_connection

__all__ = ["SSE_HEADERS", "EventStream", "sse_data", "sse_event"]

logger = logging.getLogger(__name__)

# No caching, and no buffering by a proxy (nginx's header): each event reaches the client
# as it is written.
SSE_HEADERS = {"cache-control": "no-cache", "x-accel-buffering": "no"}


def sse_data(body: dict[str, Any]) -> str:
    """One `data:` event holding body as compact JSON."""
    return f"data: {json.dumps(body, separators=(',', ':'))}\n\n"


def sse_event(kind: str, body: dict[str, Any]) -> str:
    """One typed event (`event:` names it, as the Responses API's streams do)."""
    return f"event: {kind}\n{sse_data(body)}"


class EventStream(StreamingResponse):
    """A request's event stream, whose client must keep reading: a chunk left unread for
    write_timeout_s (the socket's buffers full) ends the request as the client's leaving
    would (cancelled in the engine, recorded as aborted) and drops the connection, so a
    client that never reads holds no slot, memory or drain for longer than that."""

    def __init__(
        self,
        events: AsyncGenerator[str, None],
        write_timeout_s: float,
        headers: Mapping[str, str],
    ) -> None:
        super().__init__(events, media_type="text/event-stream", headers=headers)
        self._events = events
        self._write_timeout_s = write_timeout_s
        self._scope: Scope = {}

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        self._scope = scope
        await super().__call__(scope, receive, send)

    async def stream_response(self, send: Send) -> None:
        async def send_in_time(message: Message) -> None:
            with anyio.fail_after(self._write_timeout_s):
                await send(message)

        try:
            await super().stream_response(send_in_time)
        except TimeoutError:
            logger.warning("a stream's client left a chunk unread for %.0f s: aborting it",
                           self._write_timeout_s)
            await self._events.aclose()  # the request ends (and is recorded) here
            # Reset, not closed: a close would wait for the unread buffers to drain.
            if not await abort_connection(self._scope):
                logger.warning("the server cannot reset a connection: it stays open until "
                               "its client reads or leaves")
