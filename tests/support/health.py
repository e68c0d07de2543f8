"""The health checks as Docker runs them (healthchecks/healthcheck.py in a subprocess), a vLLM pid file, and a small
stdlib HTTP server standing in for answers vLLM gives rarely (503 from a dead engine, a model list without our name)."""

from __future__ import annotations

import http.server
import json
import os
import subprocess
import sys
import threading
from contextlib import contextmanager

from .appliance import HEALTHCHECK
from vllm_exl3.appliance.api_guard import DRAIN_MESSAGE


def run_check(mode: str, env: dict[str, str]) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, str(HEALTHCHECK), mode], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=30)


def pid_file(tmp_path, pid: int) -> dict[str, str]:
    (tmp_path / "vllm.pid").write_text(f"{pid}\n")
    return {"VLLM_EXL3_RUN_DIR": str(tmp_path)}


class Answers(http.server.BaseHTTPRequestHandler):
    routes: dict[str, tuple[int, bytes]] = {}
    key: str | None = None  # like vLLM with --api-key: /v1/* needs it, /health does not

    def do_GET(self):
        status, body = self.routes.get(self.path, (404, b""))
        if self.key and self.path.startswith("/v1/") and self.headers.get("Authorization") != f"Bearer {self.key}":
            status, body = 401, b""
        self.send_response(status)
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args):
        pass


@contextmanager
def http_server(routes, key=None):
    Answers.routes, Answers.key = routes, key
    server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Answers)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        yield server.server_address[1]
    finally:
        server.shutdown()
        server.server_close()


MODELS = json.dumps({"data": [{"id": "demo"}]}).encode()
DRAINING = json.dumps({"error": DRAIN_MESSAGE}).encode()  # the API guard's /health answer while vLLM drains
