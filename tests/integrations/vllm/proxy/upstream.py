"""A minimal OpenAI-shaped HTTP server standing in for a vLLM instance in the proxy's tests.

The proxy is the subject, so its upstreams are small real servers (standard library, real
sockets, HTTP/1.1 with chunked streams) that record every call they get and can be told to
answer with an error, stall, hold a stream at a gate, or die in the middle of one.
"""

from __future__ import annotations

import json
import socket
import threading
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any


@dataclass
class Call:
    server: str
    path: str
    body: dict[str, Any]
    headers: dict[str, str]


@dataclass
class Script:
    """How the server answers its next generate calls (reset between tests)."""

    kv_params: dict[str, Any] | None = None
    """What a prefill call (``do_remote_decode``) answers as ``kv_transfer_params``."""
    error: tuple[int, bytes] | None = None
    events: int = 3
    gates: dict[int, threading.Event] = field(default_factory=dict)
    """Event ``i`` of a stream is sent only once ``gates[i]`` is set."""
    die_after: int | None = None
    """Send this many events and half of the next, then drop the connection."""
    stall: threading.Event | None = None
    """Answer nothing until this is set."""


class FakeVllm:
    """One fake instance on 127.0.0.1, a free port; every call lands in ``calls`` (shared
    between instances, so the order of calls across them is recorded)."""

    def __init__(self, name: str, calls: list[Call]) -> None:
        self.name = name
        self.calls = calls
        self.script = Script()
        self.lock = threading.Lock()
        self.server = ThreadingHTTPServer(("127.0.0.1", 0), _handler(self))
        self.server.daemon_threads = True
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, name=f"fake-{name}", daemon=True).start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def _handler(fake: FakeVllm) -> type[BaseHTTPRequestHandler]:
    class Handler(BaseHTTPRequestHandler):
        protocol_version = "HTTP/1.1"

        def log_message(self, format: str, *args: Any) -> None:
            pass

        def _send(self, status: int, body: bytes, content_type: str = "application/json") -> None:
            self.send_response(status)
            self.send_header("Content-Type", content_type)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def do_GET(self) -> None:
            if self.path == "/health":
                self._send(200, b"")
            elif self.path == "/v1/models":
                self._send(200, json.dumps({"object": "list", "data": [{"id": fake.name}]}).encode())
            else:
                self._send(404, b'{"error": "no such path"}')

        def do_POST(self) -> None:
            body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
            with fake.lock:
                fake.calls.append(Call(fake.name, self.path, body, dict(self.headers)))
            script = fake.script
            if script.stall is not None:
                script.stall.wait(60)
                return
            if script.error is not None:
                self._send(script.error[0], script.error[1])
                return
            prefill = (body.get("kv_transfer_params") or {}).get("do_remote_decode") is True
            if not body.get("stream"):
                answer: dict[str, Any] = {"id": "x", "object": "text_completion", "choices": [
                    {"index": 0, "text": f"{fake.name} answers", "finish_reason": "length"}]}  # fmt: skip
                if prefill:
                    answer["kv_transfer_params"] = script.kv_params
                self._send(200, json.dumps(answer).encode())
                return
            self.send_response(200)
            self.send_header("Content-Type", "text/event-stream")
            self.send_header("Transfer-Encoding", "chunked")
            self.end_headers()
            try:
                self._stream(script)
            except (BrokenPipeError, ConnectionResetError):  # the proxy cut the stream off
                return

        def _stream(self, script: Script) -> None:
            for i in range(script.events):
                if i in script.gates:
                    script.gates[i].wait(60)
                event = f"data: {json.dumps({'choices': [{'text': f'{fake.name}-{i}'}]})}\n\n".encode()
                if script.die_after == i:  # half an event, then a dead connection
                    self._chunk(event[: len(event) // 2])
                    self.connection.shutdown(socket.SHUT_RDWR)
                    self.connection.close()
                    return
                self._chunk(event)
            self._chunk(b"data: [DONE]\n\n")
            self.wfile.write(b"0\r\n\r\n")

        def _chunk(self, data: bytes) -> None:
            self.wfile.write(b"%x\r\n%s\r\n" % (len(data), data))
            self.wfile.flush()

    return Handler
