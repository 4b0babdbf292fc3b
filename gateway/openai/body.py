"""A generation request's body: read with its size bounded (413 past --max-body-bytes; a
body found to be large is screened again before it is read on), then parsed as JSON into the
endpoint's request (gateway.openai.requests; gateway.openai.responses_request for the
Responses API)."""

from __future__ import annotations

from collections.abc import Awaitable, Callable

from starlette.requests import Request

from gateway.http.errors import PayloadTooLargeError
from gateway.http.json_body import declared_length, parse_json_body
from gateway.openai.requests import (
    Endpoint,
    GenerationRequest,
    RequestBounds,
    parse_chat_request,
    parse_completion_request,
)
from gateway.openai.responses_request import ResponsesCall, parse_responses_request

__all__ = ["LARGE_BODY_BYTES", "parse_body", "read_body"]

# A body this large may hold prompts that take tens of milliseconds or more to tokenize: it
# is read only when the tenant's rate limits have room (AdmissionController.screen), and its
# prompts are rendered and tokenized in a worker thread instead of on the event loop.
LARGE_BODY_BYTES = 64 << 10


async def read_body(
    request: Request, max_bytes: int, on_large: Callable[[], Awaitable[None]] | None = None
) -> bytes:
    """The body's bytes; 413 above max_bytes (checked while reading). on_large runs once,
    before the body is read on, when it is found to be larger than LARGE_BODY_BYTES (a body
    that declares its size is screened before reading starts)."""
    declared = declared_length(request)
    if declared is not None and declared > max_bytes:
        raise PayloadTooLargeError(f"the request body is larger than {max_bytes} bytes")
    chunks, size = [], 0
    async for piece in request.stream():
        size += len(piece)
        if size > max_bytes:
            raise PayloadTooLargeError(f"the request body is larger than {max_bytes} bytes")
        if on_large is not None and size > LARGE_BODY_BYTES:
            await on_large()
            on_large = None
        chunks.append(piece)
    return b"".join(chunks)


def parse_body(raw: bytes, endpoint: Endpoint, bounds: RequestBounds
               ) -> GenerationRequest | ResponsesCall:
    """The endpoint's request from the body's bytes; 400 for bad JSON or a bad field."""
    if endpoint is Endpoint.CHAT:
        return parse_chat_request(parse_json_body(raw), bounds)
    if endpoint is Endpoint.RESPONSES:
        return parse_responses_request(parse_json_body(raw), bounds)
    return parse_completion_request(parse_json_body(raw), bounds)
