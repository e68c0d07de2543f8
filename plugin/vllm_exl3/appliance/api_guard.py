"""ASGI middleware that makes vLLM's API key cover every path, not only /v1, /v2, /inference and /cohere.

vLLM loads it with `--middleware vllm_exl3.appliance.api_guard.GuardAllPaths` (the launcher adds that when
VLLM_API_KEY is set; see exposure.py). It reads the key from VLLM_API_KEY and the paths left open from
VLLM_EXL3_OPEN_PATHS (comma- or space-separated exact paths; a path ending in `/` opens everything below it).
Standard library only: it runs inside vLLM's API server but never imports vLLM.
"""

from __future__ import annotations

import hashlib
import hmac
import json
import os

from .settings import default


def open_paths(value: str) -> tuple[str, ...]:
    return tuple(p for p in value.replace(",", " ").split() if p)


def path_is_open(path: str, opened: tuple[str, ...]) -> bool:
    return any(path == p or (p.endswith("/") and path.startswith(p)) for p in opened)


class GuardAllPaths:
    def __init__(self, app, key: str | None = None, opened: str | None = None) -> None:
        self.app = app
        key = os.environ.get("VLLM_API_KEY", "") if key is None else key
        self.digest = hashlib.sha256(key.encode()).digest() if key else None
        self.opened = open_paths(os.environ.get("VLLM_EXL3_OPEN_PATHS", default("VLLM_EXL3_OPEN_PATHS"))
                                 if opened is None else opened)

    def authorized(self, scope) -> bool:
        for name, value in scope.get("headers") or ():
            if name.lower() == b"authorization":
                scheme, _, token = value.decode("latin-1").partition(" ")
                return scheme.lower() == "bearer" and hmac.compare_digest(
                    hashlib.sha256(token.encode("latin-1")).digest(), self.digest)
        return False

    async def __call__(self, scope, receive, send):
        if (self.digest is None or scope["type"] not in ("http", "websocket") or scope.get("method") == "OPTIONS"
                or path_is_open(scope["path"].removeprefix(scope.get("root_path", "")), self.opened)
                or self.authorized(scope)):
            return await self.app(scope, receive, send)
        if scope["type"] == "websocket":
            return await send({"type": "websocket.close", "code": 1008})
        body = json.dumps({"error": "Unauthorized: send `Authorization: Bearer <key>`"}).encode()
        await send({"type": "http.response.start", "status": 401,
                    "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                                (b"www-authenticate", b"Bearer")]})
        await send({"type": "http.response.body", "body": body})
