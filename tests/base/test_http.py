"""base/http.py against a local stdlib HTTP server: JSON GET/POST, error statuses, nothing listening."""

from __future__ import annotations

import json
import socket
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import pytest

from vllm_exl3.base.http import http_json, http_request


class Handler(BaseHTTPRequestHandler):
    def log_message(self, *args):
        pass

    def _answer(self, status: int, payload: dict) -> None:
        raw = json.dumps(payload).encode()
        self.send_response(status)
        self.send_header("Content-Length", str(len(raw)))
        self.end_headers()
        self.wfile.write(raw)

    def do_GET(self):
        if self.path == "/missing":
            self._answer(404, {})
        else:
            self._answer(200, {"path": self.path, "auth": self.headers.get("Authorization")})

    def do_POST(self):
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        self._answer(200, {"echo": body, "type": self.headers.get("Content-Type")})


@pytest.fixture(scope="module")
def base():
    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()


def test_get_post_and_key(base):
    assert http_json(base + "/v1/models", 5, api_key="k") == {"path": "/v1/models", "auth": "Bearer k"}
    assert http_json(base + "/x", 5, {"a": 1}) == {"echo": {"a": 1}, "type": "application/json"}
    assert http_request(base + "/missing", 5) == (404, b"{}")  # the error status and the server's error document
    with pytest.raises(RuntimeError, match="HTTP 404"):
        http_json(base + "/missing", 5)


def test_nothing_listening():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    assert http_request(f"http://127.0.0.1:{port}/health", 2) == (None, b"")
