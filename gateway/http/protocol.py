"""The server's HTTP protocol: uvicorn's httptools protocol with a bounded kernel send buffer
per connection, and a way for a response to reset its connection.

Each connection's kernel send buffer is held to SEND_BUFFER_BYTES (Linux otherwise grows it
up to `tcp_wmem`'s maximum, 4 MiB): what a client that stops reading can make the server hold
is bounded, and its stream's writes block, so the write timeout starts, after that much
rather than after megabytes of generated tokens.

A streamed response that gives up on a client that never reads returns without finishing;
uvicorn then closes the transport, and a transport waits for its write buffer to drain before
it closes the socket; and a socket closed with unsent data keeps it (and its FIN) queued in
the kernel. A client that never reads would keep the connection, its file descriptor and the
kernel's send buffer (up to `tcp_wmem`'s maximum, 4 MiB) for as long as it likes. The
protocol therefore puts the connection's transport in each request's scope, and
`abort_connection` closes it with SO_LINGER 0: a reset, everything buffered discarded.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import MutableMapping
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_TRANSPORT = "tiergate.transport"
# A stream's events are small; 256 KiB carries thousands of them, and a 100 ms round trip
# at 2.5 MB/s.
SEND_BUFFER_BYTES = 256 * 1024


class GatewayHttpProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol: send buffers of at most SEND_BUFFER_BYTES, and the
    connection's transport in every request's scope."""

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        sock = transport.get_extra_info("socket")
        if sock is not None:  # a smaller buffer set on the listener (tests) is kept
            current = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
            if current > SEND_BUFFER_BYTES:
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF, SEND_BUFFER_BYTES)
        super().connection_made(transport)

    def on_message_begin(self) -> None:
        super().on_message_begin()
        scope: dict[str, Any] = self.scope  # type: ignore[assignment]
        scope[_TRANSPORT] = self.transport


async def abort_connection(scope: MutableMapping[str, Any]) -> bool:
    """Reset the request's connection (False when the server gives no way to): buffered
    output is discarded. Returns after the server has seen the connection go, so it does not
    report the unfinished response as the application's error."""
    transport: asyncio.Transport | None = scope.get(_TRANSPORT)
    if transport is None:
        return False
    sock = transport.get_extra_info("socket")
    if sock is not None:  # linger 0: close() resets instead of queueing the rest and a FIN
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    transport.abort()
    await asyncio.sleep(0)  # connection_lost runs: uvicorn marks the cycle disconnected
    return True
