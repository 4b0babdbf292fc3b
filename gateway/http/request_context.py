"""ASGI middleware: a request id on every request and response, and the processing time.

``x-request-id`` is echoed when the client sent a usable one (printable ASCII, at most 128
characters) and generated otherwise; ``openai-processing-ms`` is the time from receiving the
request to sending the response headers, as OpenAI reports it.
"""

from __future__ import annotations

import secrets
import time

from starlette.datastructures import MutableHeaders
from starlette.types import ASGIApp, Message, Receive, Scope, Send

MAX_REQUEST_ID_LENGTH = 128


def _usable(request_id: str) -> bool:
    return 0 < len(request_id) <= MAX_REQUEST_ID_LENGTH and all(
        33 <= ord(c) <= 126 for c in request_id
    )


class RequestContextMiddleware:
    def __init__(self, app: ASGIApp) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        started = time.monotonic()
        presented = ""
        for name, value in scope["headers"]:
            if name == b"x-request-id":
                presented = value.decode("latin-1")
                break
        request_id = presented if _usable(presented) else f"req_{secrets.token_hex(16)}"
        scope.setdefault("state", {})["request_id"] = request_id

        async def send_with_headers(message: Message) -> None:
            if message["type"] == "http.response.start":
                headers = MutableHeaders(scope=message)
                headers["x-request-id"] = request_id
                elapsed_ms = (time.monotonic() - started) * 1000
                headers["openai-processing-ms"] = str(round(elapsed_ms))
            await send(message)

        await self.app(scope, receive, send_with_headers)
