"""The one HTTP client of the package (the appliance's health checks, the CLI, the dev tools): JSON over urllib to a
vLLM server (standard library only, so the healthcheck stays torch-free and fast). The serving benchmark's
streaming client is servebench/client.py (aiohttp)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from typing import Any


def http_request(url: str, timeout: float, body: dict | None = None,
                 api_key: str | None = None) -> tuple[int | None, bytes]:
    """GET `url` (POST `body` as JSON when given): (status, response body); status None when nothing answers
    (refused, timeout). On an HTTP error status the body is the server's error document (vLLM's JSON error)."""
    headers = {"Content-Type": "application/json"} if body is not None else {}
    if api_key:
        headers["Authorization"] = f"Bearer {api_key}"
    data = json.dumps(body).encode() if body is not None else None
    try:
        with urllib.request.urlopen(urllib.request.Request(url, data=data, headers=headers),  # noqa: S310
                                    timeout=timeout) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        try:
            return e.code, e.read()
        except OSError:
            return e.code, b""
    except (urllib.error.URLError, OSError):
        return None, b""


def http_json(url: str, timeout: float, body: dict | None = None, api_key: str | None = None) -> Any:
    """The decoded JSON answer of a request that must succeed (status 200); RuntimeError naming the URL otherwise."""
    status, raw = http_request(url, timeout, body, api_key)
    if status != 200:
        raise RuntimeError(f"{url}: " + (f"HTTP {status}" if status else "no answer"))
    return json.loads(raw or b"{}")
