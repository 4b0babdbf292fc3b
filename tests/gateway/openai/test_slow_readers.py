"""Streams whose clients never read: each write the server cannot finish within
--stream-write-timeout ends the request as a disconnect would (cancelled in the engine,
recorded as aborted, its connection reset), so such clients hold no engine slot, no
memory, no connection and no drain past the timeout; a client that reads is served
meanwhile.

The replica runs in this process (tests/gateway/app_harness.py) with small socket send
buffers; the silent clients are raw sockets with small receive buffers.
"""

from __future__ import annotations

import socket
import time
from pathlib import Path

from sqlalchemy import select

from bench.serve.raw_client import post_request, unread_stream
from billing import RecordStatus, UsageRecordRow
from gateway.openai.generation import MAX_UNREAD_OUTPUTS_PER_CHOICE
from gateway.server.model_source import DEMO_MODEL_NAME
from tests.gateway.app_harness import start_gateway

NUM_SILENT = 4
WRITE_TIMEOUT_S = 1.0
_TCP_ESTABLISHED = 1  # tcpi_state, the first byte of Linux's struct tcp_info


def _is_established(sock: socket.socket) -> bool:
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 1)[0] == _TCP_ESTABLISHED


def _silent_stream(port: int, key: str) -> socket.socket:
    """A streamed chat sent from a socket that will never read its answer."""
    body = {
        "model": DEMO_MODEL_NAME, "max_tokens": 1500, "stream": True, "ignore_eos": True,
        "messages": [{"role": "user", "content": "talk"}],
    }
    return unread_stream(port, post_request("/v1/chat/completions", key, body), 4096)


def test_streams_that_are_never_read_are_aborted_after_the_write_timeout(
    tmp_path: Path,
) -> None:
    gateway = start_gateway(
        tmp_path, send_buffer_bytes=4096, stream_write_timeout_s=WRITE_TIMEOUT_S
    )
    silent: list[socket.socket] = []
    try:
        _, key = gateway.create_tenant("silent", "standard")
        port = int(gateway.base_url.rsplit(":", 1)[1])
        started = time.monotonic()
        silent = [_silent_stream(port, key) for _ in range(NUM_SILENT)]
        # A reading client is served meanwhile.
        reader = gateway.openai_client(key, timeout=30)
        assert reader.chat.completions.create(
            model=DEMO_MODEL_NAME, messages=[{"role": "user", "content": "hi"}], max_tokens=2
        ).choices
        deadline = time.monotonic() + 30
        while gateway.runtime.num_in_flight:
            assert time.monotonic() < deadline, gateway.runtime.num_in_flight
            time.sleep(0.05)
        freed_s = time.monotonic() - started
        stats = gateway.runtime.host().stats()
        assert sum(tier.num_running for tier in stats.tiers.values()) == 0
        with gateway.runtime.session_factory() as session:
            statuses = list(session.scalars(select(UsageRecordRow.status)))
        # The server reset each connection (a close would wait for the unread buffers to
        # drain, which a client that never reads never lets happen).
        while any(_is_established(sock) for sock in silent):
            assert time.monotonic() < deadline, "the server kept the silent connections"
            time.sleep(0.05)
    finally:
        for sock in silent:
            sock.close()
        gateway.stop()
    print(f"\n{NUM_SILENT} streams never read: every one aborted and freed {freed_s:.1f} s "
          f"after they were sent (write timeout {WRITE_TIMEOUT_S} s)")
    assert sorted(statuses) == sorted(
        [RecordStatus.COMPLETED] + [RecordStatus.ABORTED] * NUM_SILENT
    )
    # Each silent one was aborted, not served to the end (1,500 tokens take far longer).
    assert freed_s < 15


def test_the_engine_stops_generating_for_a_stream_left_unread(tmp_path: Path) -> None:
    """Long before its write timeout, a stream whose client does not read stops costing the
    engine: once MAX_UNREAD_OUTPUTS_PER_CHOICE outputs wait unread, its engine request is
    aborted (what waits for the client is bounded); the request ends, recorded as aborted,
    when the client goes."""
    gateway = start_gateway(tmp_path, send_buffer_bytes=4096, stream_write_timeout_s=600.0)
    try:
        _, key = gateway.create_tenant("silent", "standard")
        port = int(gateway.base_url.rsplit(":", 1)[1])
        sock = _silent_stream(port, key)
        deadline = time.monotonic() + 30
        running = 1
        while running or not gateway.runtime.num_in_flight:
            assert time.monotonic() < deadline, "the engine kept generating"
            time.sleep(0.05)
            stats = gateway.runtime.host().stats()
            running = sum(t.num_running + t.num_waiting for t in stats.tiers.values())
        assert gateway.runtime.num_in_flight == 1  # held by its connection, not the engine
        sock.close()
        while gateway.runtime.num_in_flight:
            assert time.monotonic() < deadline, "the request outlived its client"
            time.sleep(0.05)
        with gateway.runtime.session_factory() as session:
            rows = list(session.execute(
                select(UsageRecordRow.status, UsageRecordRow.num_completion_tokens)
            ))
    finally:
        gateway.stop()
    print(f"\na stream never read: its engine request stopped after {rows[0][1]} of 1,500 "
          f"tokens (at most {MAX_UNREAD_OUTPUTS_PER_CHOICE} unread outputs)")
    assert len(rows) == 1 and rows[0][0] == RecordStatus.ABORTED
    assert rows[0][1] < 1500
