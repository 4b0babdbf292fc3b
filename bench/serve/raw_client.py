"""HTTP requests written on a raw socket, for clients no HTTP library would be: one that
never reads its answer (a small receive buffer, the stream left unread) or one that drops
the connection after the first bytes (ops/bench's hostile-tenant scripts, the slow-reader
tests)."""

from __future__ import annotations

import json
import socket
from collections.abc import Mapping
from typing import Any

__all__ = ["post_request", "unread_stream"]


def post_request(path: str, key: str, body: Mapping[str, Any]) -> bytes:
    """The bytes of an HTTP/1.1 POST of body as JSON to path, presenting key."""
    payload = json.dumps(body).encode()
    return (
        f"POST {path} HTTP/1.1\r\nhost: tiergate\r\n".encode()
        + f"authorization: Bearer {key}\r\ncontent-type: application/json\r\n".encode()
        + f"content-length: {len(payload)}\r\n\r\n".encode() + payload
    )


def unread_stream(port: int, request: bytes, rcvbuf_bytes: int) -> socket.socket:
    """A loopback connection to port that sends request and reads nothing: its receive
    buffer, rcvbuf_bytes, set before connecting, fills and the server's writes block."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, rcvbuf_bytes)
    sock.connect(("127.0.0.1", port))
    sock.sendall(request)
    return sock
