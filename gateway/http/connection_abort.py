"""Resetting a connection at once, for a response that must end it without its buffers.

A streamed response that gives up on a client that never reads returns without finishing;
uvicorn then closes the transport, and a transport waits for its write buffer to drain before
it closes the socket; and a socket closed with unsent data keeps it (and its FIN) queued in
the kernel. A client that never reads would keep the connection, its file descriptor and the
kernel's send buffer (up to `tcp_wmem`'s maximum, 4 MiB) for as long as it likes. The
server's HTTP protocol (uvicorn's httptools protocol, which `tiergate serve` runs) therefore
puts the connection's transport in each request's scope, and `abort_connection` closes it
with SO_LINGER 0: a reset, everything buffered discarded.
"""

from __future__ import annotations

import asyncio
import socket
import struct
from collections.abc import MutableMapping
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol

_TRANSPORT = "tiergate.transport"


class AbortableHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol, with the connection's transport in every request's
    scope."""

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
