"""LoopbackReceiver: a real HTTP server on 127.0.0.1 that records every POST, standing in for
Alertmanager, PagerDuty or an OTLP collector in the gateway tests."""

from __future__ import annotations

import json
import threading
import time
from dataclasses import dataclass
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Received:
    path: str
    headers: dict[str, str]  # names in lower case
    body: bytes

    def json(self) -> Any:
        return json.loads(self.body)


class LoopbackReceiver:
    """Test tool: a real HTTP server on 127.0.0.1 recording every POST.

    fail_next[path] = [status, ...] answers the next POSTs to path with those statuses.
    """

    def __init__(self) -> None:
        self.received: list[Received] = []
        self.fail_next: dict[str, list[int]] = {}
        self.delay_s = 0.0
        self._lock = threading.Lock()
        receiver = self

        class Handler(BaseHTTPRequestHandler):
            def do_POST(self) -> None:
                body = self.rfile.read(int(self.headers.get("content-length", "0")))
                time.sleep(receiver.delay_s)
                with receiver._lock:
                    receiver.received.append(
                        Received(self.path, {k.lower(): v for k, v in self.headers.items()}, body)
                    )
                    pending = receiver.fail_next.get(self.path)
                    status = pending.pop(0) if pending else 200
                self.send_response(status)
                self.send_header("content-type", "application/json")
                self.end_headers()
                self.wfile.write(b'{"status": "success"}')

            def log_message(self, format: str, *args: Any) -> None:
                pass

        self._server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self._thread = threading.Thread(
            target=self._server.serve_forever, kwargs={"poll_interval": 0.05}, daemon=True
        )
        self._thread.start()

    def url(self, path: str) -> str:
        host, port = self._server.server_address[:2]
        return f"http://{host!s}:{port}{path}"

    def posts(self, path: str) -> list[Received]:
        with self._lock:
            return [r for r in self.received if r.path == path]

    def close(self) -> None:
        self._server.shutdown()
        self._server.server_close()
        self._thread.join()
