"""ASGI middleware in front of vLLM's API server: the key on every path, 503 while draining, idle connections closed.

vLLM loads it with `--middleware vllm_exl3.appliance.api_guard.GuardAllPaths`, which the launcher and
`vllm-exl3 serve` always add (exposure.py). vLLM adds user middleware after its own (vllm/entrypoints/serve/
middleware/register.py), so this one runs first, in front of vLLM's CORS and key checks. Standard library only:
it runs inside vLLM's API server but never imports vLLM.

- The key. vLLM checks VLLM_API_KEY only under /v1, /v2, /inference and /cohere; with a key set, this checks it
  on every path except GET and HEAD of VLLM_EXL3_OPEN_PATHS (comma- or space-separated exact paths; a path ending
  in `/` opens everything below it). Without the key an OPTIONS request passes only as a CORS preflight (it
  carries Origin and Access-Control-Request-Method): vLLM's CORS middleware answers that itself and calls no
  route. Any other OPTIONS would reach the route, and /metrics answers every method with the full scrape.
- Draining. On SIGTERM vLLM lets running requests finish for --shutdown-timeout seconds but has already shut
  the executors new requests need: they fail with 500 ("cannot schedule new futures after shutdown") while
  /health still says 200. From the moment vLLM starts shutting its engine client down, every new request gets
  503 with Retry-After, so clients and load balancers go elsewhere; running streams continue.
- Sequences per request. vLLM bounds `n` per prompt (VLLM_MAX_N_SEQUENCES, which the launcher and `vllm-exl3
  serve` set to --max-num-seqs, exposure.py), but a completion request takes a list of prompts: 1024 prompts
  with n 8 are 8,192 sequences in one request. The guard reads a completion request's body and answers 400 when a
  request of several prompts asks for more sequences in all than the same bound.
- Idle connections. uvicorn closes a kept-alive connection some seconds after a response, but a connection that
  never sends a complete request head stays open for ever (thousands of them hold thousands of descriptors). A
  connection without a request in progress for VLLM_EXL3_HTTP_IDLE_TIMEOUT seconds is closed.
"""

from __future__ import annotations

import asyncio
import hashlib
import hmac
import json
import os
import time
import weakref

from ..base import settings

READ_METHODS = ("GET", "HEAD")
DRAIN_RETRY_AFTER_S = 5
DRAIN_MESSAGE = "the server is shutting down; retry on another server"
SWEEP_INTERVAL_S = 1.0


COMPLETIONS_PATH = "/v1/completions"  # the one OpenAI route that takes many prompts in one request
MAX_SEQUENCES_ENV = "VLLM_MAX_N_SEQUENCES"  # vLLM's own per-prompt bound on n (vllm/envs.py); 0 or unset: none


def max_sequences(value: str | None) -> int:
    try:
        return max(0, int(value or 0))
    except ValueError:
        return 0  # vLLM itself refuses to start on a malformed value


async def read_body(receive):
    """The whole request body, and a receive() that hands it to the app as if unread."""
    chunks, pending = [], []
    while True:
        message = await receive()
        if message["type"] != "http.request":
            pending.append(message)  # the client went away: the app sees that as it would have
            break
        chunks.append(message.get("body", b""))
        if not message.get("more_body"):
            break
    body = b"".join(chunks)
    pending.insert(0, {"type": "http.request", "body": body, "more_body": False})

    async def replay():
        return pending.pop(0) if pending else await receive()

    return body, replay


def sequences_asked(body: bytes) -> tuple[int, int] | None:
    """(prompts, n) of a completion request; None when the body is not one (vLLM answers that itself)."""
    try:
        request = json.loads(body)
    except ValueError:
        return None
    if not isinstance(request, dict):
        return None
    prompt, n = request.get("prompt"), request.get("n", 1)
    if not isinstance(n, int) or isinstance(n, bool) or n < 1:
        return None
    if isinstance(prompt, list) and prompt and not all(isinstance(t, int) for t in prompt):
        return len(prompt), n  # a list of prompts (texts or token lists); a flat token list is one prompt
    return 1, n


def open_paths(value: str) -> tuple[str, ...]:
    return tuple(p for p in value.replace(",", " ").split() if p)


def path_is_open(path: str, opened: tuple[str, ...]) -> bool:
    return any(path == p or (p.endswith("/") and path.startswith(p)) for p in opened)


def header(scope, name: bytes) -> bytes | None:
    for key, value in scope.get("headers") or ():
        if key.lower() == name:
            return value
    return None


def is_cors_preflight(scope) -> bool:
    return (scope.get("method") == "OPTIONS" and header(scope, b"origin") is not None
            and header(scope, b"access-control-request-method") is not None)


class GuardAllPaths:
    def __init__(self, app, key: str | None = None, opened: str | None = None,
                 idle_timeout: float | None = None, max_seqs: int | None = None) -> None:
        self.app = app
        key = os.environ.get("VLLM_API_KEY", "") if key is None else key
        self.digest = hashlib.sha256(key.encode()).digest() if key else None
        self.opened = open_paths(settings.get("VLLM_EXL3_OPEN_PATHS", keep_empty=True) if opened is None else opened)
        self.idle_timeout = settings.get_float("VLLM_EXL3_HTTP_IDLE_TIMEOUT") if idle_timeout is None else idle_timeout
        self.max_sequences = max_sequences(os.environ.get(MAX_SEQUENCES_ENV)) if max_seqs is None else max_seqs
        self.draining = False
        self.sweeper: asyncio.Task | None = None

    def authorized(self, scope) -> bool:
        value = header(scope, b"authorization")
        if value is None:
            return False
        scheme, _, token = value.decode("latin-1").partition(" ")
        return scheme.lower() == "bearer" and hmac.compare_digest(
            hashlib.sha256(token.encode("latin-1")).digest(), self.digest)

    def admitted(self, scope) -> bool:
        if self.digest is None or is_cors_preflight(scope) or self.authorized(scope):
            return True
        path = scope["path"].removeprefix(scope.get("root_path", ""))
        return scope["type"] == "http" and scope.get("method") in READ_METHODS and path_is_open(path, self.opened)

    async def __call__(self, scope, receive, send):
        if scope["type"] == "lifespan":
            self.start(scope.get("app"))
            return await self.app(scope, receive, send)
        if scope["type"] not in ("http", "websocket"):
            return await self.app(scope, receive, send)
        if self.draining:
            return await refuse(scope, send, 503, DRAIN_MESSAGE,
                                [(b"retry-after", str(DRAIN_RETRY_AFTER_S).encode()), (b"connection", b"close")])
        if not self.admitted(scope):
            return await refuse(scope, send, 401, "Unauthorized: send `Authorization: Bearer <key>`",
                                [(b"www-authenticate", b"Bearer")])
        if self.max_sequences and scope.get("method") == "POST" and scope["path"].endswith(COMPLETIONS_PATH):
            body, receive = await read_body(receive)
            asked = sequences_asked(body)
            # One prompt: vLLM's own per-prompt bound answers it, with its own message.
            if asked is not None and asked[0] > 1 and asked[0] * asked[1] > self.max_sequences:
                prompts, n = asked
                return await refuse(scope, send, 400, f"this request asks for {prompts * n} sequences ({prompts} "
                                    f"prompts x n {n}); this server runs at most {self.max_sequences} per request "
                                    "(its --max-num-seqs): send fewer prompts or a smaller n per request", [],
                                    openai_param="n")
        return await self.app(scope, receive, send)

    # --- the server around the app: vLLM's engine client and uvicorn's connections -------------------------------
    def start(self, app) -> None:
        """At the server's start: learn when vLLM begins to drain, and start closing idle connections. vLLM keeps
        its engine client and its uvicorn server in the app's state (vllm/entrypoints/launchers/launcher.py)."""
        state = getattr(app, "state", None)
        client = getattr(state, "engine_client", None)
        if client is not None and callable(getattr(client, "shutdown", None)):
            shutdown = client.shutdown

            def draining_shutdown(*args, **kwargs):  # vLLM's SIGTERM handler calls it first, then drains
                self.draining = True
                return shutdown(*args, **kwargs)

            client.shutdown = draining_shutdown
        server = getattr(state, "server", None)
        if server is not None and self.idle_timeout > 0 and self.sweeper is None:
            self.sweeper = asyncio.get_running_loop().create_task(sweep_idle(server, self.idle_timeout))


async def refuse(scope, send, status: int, message: str, headers: list[tuple[bytes, bytes]],
                 openai_param: str | None = None) -> None:
    """openai_param: a refused request's value, answered in vLLM's (OpenAI's) error shape so clients show it."""
    if scope["type"] == "websocket":
        return await send({"type": "websocket.close", "code": 1013 if status == 503 else 1008})
    error = {"message": message, "type": "BadRequestError", "param": openai_param, "code": status} \
        if openai_param else message
    body = json.dumps({"error": error}).encode()
    await send({"type": "http.response.start", "status": status,
                "headers": [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
                            *headers]})
    await send({"type": "http.response.body", "body": body})


def is_drain_answer(status: int | None, body: bytes) -> bool:
    """The guard's 503 while vLLM drains after SIGTERM (an orderly stop under way), not vLLM's 503 of a dead
    engine: the liveness checks must not count a drain as a death (health.py)."""
    if status != 503:
        return False
    try:
        return json.loads(body).get("error") == DRAIN_MESSAGE
    except (ValueError, AttributeError):
        return False


def idle(connection) -> bool:
    """A uvicorn HTTP connection with no request in progress: none yet (its head not complete), or the last one
    answered. WebSocket connections (no `cycle`) are never idle here."""
    if not hasattr(connection, "cycle"):
        return False
    cycle = connection.cycle
    return cycle is None or bool(getattr(cycle, "response_complete", False))


async def sweep_idle(server, timeout: float, interval: float = SWEEP_INTERVAL_S, clock=time.monotonic) -> None:
    """Close connections that stay idle for `timeout` seconds (uvicorn's `server_state.connections`)."""
    since: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # connection -> (its request then, idle since)
    while True:
        await asyncio.sleep(interval)
        now = clock()
        for connection in list(getattr(getattr(server, "server_state", None), "connections", ())):
            if not idle(connection):
                since.pop(connection, None)
                continue
            cycle, first = since.get(connection, (None, None))
            if first is None or cycle is not connection.cycle:  # first seen idle, or a request came in between
                since[connection] = (connection.cycle, now)
                continue
            transport = getattr(connection, "transport", None)
            if now - first >= timeout and transport is not None and not transport.is_closing():
                transport.close()
