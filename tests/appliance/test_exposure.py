"""Safe network defaults: the API's bind address and key rule (exposure.py), the middleware that makes the key cover
every path (api_guard.py), and preflight's point-to-point check of the fabric link."""

from __future__ import annotations

import asyncio
import ipaddress
import json
import random
import socket
import subprocess
import sys
import threading
import time
from contextlib import contextmanager

import pytest

from support.servers import free_port
from vllm_exl3 import demo
from vllm_exl3.appliance import exposure
from vllm_exl3.appliance.api_guard import GuardAllPaths
from vllm_exl3.appliance.launch import EXIT_REFUSED, build_spec, load_preset
from vllm_exl3.appliance.preflight import check_point_to_point


@pytest.mark.parametrize("env,host", [
    ({}, "127.0.0.1"),
    ({"VLLM_API_KEY": "k"}, "0.0.0.0"),
    ({"VLLM_API_KEY": "  "}, "127.0.0.1"),  # a blank key is no key
    ({"VLLM_EXL3_HOST": "10.0.0.5"}, "10.0.0.5"),
    ({"VLLM_EXL3_HOST": "10.0.0.5", "VLLM_API_KEY": "k"}, "10.0.0.5"),
])
def test_bind_address(env, host):
    assert exposure.api_host(env) == host
    flags = build_spec("single", load_preset("spark-1x", {}), env).flags
    assert flags["host"] == host  # always explicit: vLLM's default is every interface
    assert flags["middleware"] == exposure.GUARD_MIDDLEWARE  # key or not: 503 while draining, idle connections closed


@pytest.mark.parametrize("host,env,refused", [
    ("127.0.0.1", {}, False), ("::1", {}, False), ("localhost", {}, False), ("127.0.0.2", {}, False),
    ("0.0.0.0", {}, True), ("192.168.1.5", {}, True), ("::", {}, True), ("spark.lan", {}, True),
    ("0.0.0.0", {"VLLM_API_KEY": "k"}, False),
    ("0.0.0.0", {"VLLM_EXL3_ALLOW_OPEN_API": "1"}, False), ("0.0.0.0", {"VLLM_EXL3_ALLOW_OPEN_API": "no"}, True),
])
def test_open_bind_without_key_is_refused(host, env, refused):
    why = exposure.refusal(host, env)
    assert (why is not None) == refused
    if why:
        assert "VLLM_API_KEY" in why and "ALLOW_OPEN_API" in why and "127.0.0.1" in why


def launch(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    base = {"PATH": "/usr/bin:/bin", "VLLM_EXL3_MODEL": str(demo.PACK)}
    return subprocess.run([sys.executable, "-m", "vllm_exl3.cli", "launch", "--role", "single", "--dry-run", *args],
                          capture_output=True, text=True, env=base | env, timeout=300)


@pytest.mark.parametrize("where", ["VLLM_EXL3_EXTRA_ARGS", "--"])
def test_an_abbreviated_host_is_read_as_vllm_reads_it(where):
    """vLLM's parser takes `--ho` for `--host`: the launcher must not log "loopback only" while vLLM listens on
    every interface with no key."""
    args = ["--ho", "0.0.0.0"]
    if where == "--":
        r = launch({}, "--no-preflight", "--", *args)
    else:
        r = launch({where: " ".join(args)}, "--no-preflight")
    assert r.returncode == EXIT_REFUSED, r.stderr
    assert "REFUSED: the API would listen on every interface with no key" in r.stderr
    assert "loopback only" not in r.stderr


def test_launch_refuses_an_open_api_even_without_preflight():
    r = launch({"VLLM_EXL3_HOST": "0.0.0.0"}, "--no-preflight")
    assert r.returncode == EXIT_REFUSED, r.stderr
    assert "REFUSED: the API would listen on every interface with no key" in r.stderr
    assert "--no-preflight" not in r.stderr.split("refused before starting vLLM")[1]  # it is no way out here
    r = launch({"VLLM_EXL3_HOST": "0.0.0.0", "VLLM_EXL3_ALLOW_OPEN_API": "1"}, "--no-preflight")
    assert r.returncode == 0 and "--host 0.0.0.0" in r.stdout and "with NO key" in r.stderr
    r = launch({"VLLM_API_KEY": "k"}, "--no-preflight")
    assert r.returncode == 0 and "--host 0.0.0.0" in r.stdout
    assert f"--middleware {exposure.GUARD_MIDDLEWARE}" in r.stdout
    assert "key required on every path except /health,/metrics" in r.stderr


# --- the middleware, driven as an ASGI server would -----------------------------------------------------------
def call(guard: GuardAllPaths, path: str, headers=(), method="GET", kind="http"):
    sent, reached = [], []

    async def app(scope, receive, send):
        reached.append(scope["path"])

    async def send(message):
        sent.append(message)

    async def receive():
        return {"type": "http.request"}

    guard.app = app
    scope = {"type": kind, "path": path, "method": method, "root_path": "", "headers": list(headers)}
    asyncio.run(guard(scope, receive, send))
    return (200 if reached else sent[0].get("status", sent[0]["type"])), sent


@pytest.mark.parametrize("path", ["/invocations", "/tokenize", "/detokenize", "/metrics/", "/version", "/v1/models",
                                  "/ping", "/anything"])
def test_guard_refuses_every_path_without_the_key(path):
    guard = GuardAllPaths(None, key="s3cret", opened="/health")
    status, sent = call(guard, path)
    assert status == 401 and b"Bearer" in sent[1]["body"]
    assert call(guard, path, [(b"authorization", b"Bearer s3cret")])[0] == 200
    assert call(guard, path, [(b"authorization", b"Bearer wrong")])[0] == 401
    assert call(guard, path, [(b"authorization", b"Basic s3cret")])[0] == 401


def test_guard_open_paths_and_pass_through():
    guard = GuardAllPaths(None, key="s3cret", opened="/health, /metrics /static/")
    assert call(guard, "/health")[0] == 200 and call(guard, "/metrics")[0] == 200
    assert call(guard, "/static/x.css")[0] == 200
    assert call(guard, "/healthz")[0] == 401  # exact paths, not prefixes
    assert call(guard, "/ws", kind="websocket")[0] == "websocket.close"
    assert call(GuardAllPaths(None, key="", opened=""), "/invocations")[0] == 200  # no key: vLLM's behaviour


PREFLIGHT = [(b"origin", b"https://app.example"), (b"access-control-request-method", b"POST")]


def test_options_passes_only_as_a_cors_preflight():
    """/metrics answers every method with the full scrape: a bare OPTIONS must not reach it without the key.
    A CORS preflight (Origin + Access-Control-Request-Method) passes: vLLM's CORS middleware answers it itself."""
    guard = GuardAllPaths(None, key="s3cret", opened="/health")
    assert call(guard, "/metrics", method="OPTIONS")[0] == 401
    assert call(guard, "/metrics", [(b"origin", b"https://app.example")], method="OPTIONS")[0] == 401
    assert call(guard, "/metrics", PREFLIGHT[1:], method="OPTIONS")[0] == 401
    assert call(guard, "/v1/models", PREFLIGHT, method="OPTIONS")[0] == 200
    assert call(guard, "/metrics", [(b"authorization", b"Bearer s3cret")], method="OPTIONS")[0] == 200


METHODS = ["GET", "HEAD", "POST", "PUT", "DELETE", "PATCH", "OPTIONS", "TRACE", "get", "CONNECT"]
PATHS = ["/health", "/metrics", "/metrics/", "/static/a.css", "/v1/completions", "/invocations", "/tokenize", "/"]


def test_guard_fuzz_no_unauthenticated_request_reaches_a_route_but_reads_of_open_paths():
    """Seeded fuzz over methods, paths and headers: without the key, only GET/HEAD of an open path and CORS
    preflights (which vLLM's CORS middleware answers without a route) get past the guard."""
    rng = random.Random(20)
    guard = GuardAllPaths(None, key="s3cret", opened="/health /static/")
    for _ in range(400):
        method, path = rng.choice(METHODS), rng.choice(PATHS)
        headers = [h for h in (*PREFLIGHT, (b"authorization", rng.choice([b"Bearer nope", b"Basic s3cret", b""])))
                   if rng.random() < 0.5]
        status, _ = call(guard, path, headers, method=method)
        preflight = method == "OPTIONS" and len([h for h in headers if h in PREFLIGHT]) == 2
        readable = method in ("GET", "HEAD") and (path == "/health" or path.startswith("/static/"))
        assert (status == 200) == (preflight or readable), (method, path, headers, status)


# --- the fabric link -------------------------------------------------------------------------------------------
ARP_HEADER = "IP address       HW type     Flags       HW address            Mask     Device\n"


def networks(cidr: str, iface: str = "enp1s0f1np1"):
    return lambda: {"lo": [ipaddress.ip_interface("127.0.0.1/8")], iface: [ipaddress.ip_interface(cidr)]}


def arp(tmp_path, *rows: str):
    (tmp_path / "proc/net").mkdir(parents=True, exist_ok=True)
    (tmp_path / "proc/net/arp").write_text(ARP_HEADER + "".join(rows))
    return tmp_path


def row(ip: str, iface: str = "enp1s0f1np1", flags: str = "0x2") -> str:
    return f"{ip}  0x1  {flags}  aa:bb:cc:dd:ee:ff  *  {iface}\n"


@pytest.mark.parametrize("cidr", ["192.168.100.10/31", "192.168.100.10/30", "fd00::1/127"])
def test_point_to_point_subnets_pass(tmp_path, cidr):
    local = cidr.split("/")[0]
    c = check_point_to_point(local, None, arp(tmp_path), networks(cidr))
    assert c.ok and not c.warning and c.checked and "enp1s0f1np1" in c.detail


def test_one_neighbour_passes_more_warn(tmp_path):
    root = arp(tmp_path, row("192.168.100.11"), row("10.0.0.1", iface="wlan0"), row("192.168.100.12", flags="0x0"))
    c = check_point_to_point("192.168.100.10", "192.168.100.11", root, networks("192.168.100.10/24"))
    assert c.ok and not c.warning and "one neighbour, 192.168.100.11" in c.detail  # incomplete entries don't count
    c = check_point_to_point("192.168.100.10", "192.168.100.99", root, networks("192.168.100.10/24"))
    assert c.ok and c.warning  # the one neighbour is not the peer
    root = arp(tmp_path, row("192.168.100.11"), row("192.168.100.12"))
    c = check_point_to_point("192.168.100.10", None, root, networks("192.168.100.10/24"))
    assert c.ok and c.warning and "2 neighbour(s)" in c.detail and "firewall" in c.detail


def test_point_to_point_not_checkable(tmp_path):
    assert not check_point_to_point("10.9.9.9", None, arp(tmp_path), networks("192.168.100.10/31")).checked
    assert not check_point_to_point("spark-a", None, arp(tmp_path), networks("192.168.100.10/31")).checked


# --- the guard in a real uvicorn server (what vLLM runs): connections that send no request are closed ----------
@contextmanager
def guarded_server(idle_timeout: float):
    """Starlette + uvicorn as vLLM builds them: the guard as app middleware, the server in the app's state."""
    import uvicorn
    from starlette.applications import Starlette
    from starlette.middleware import Middleware
    from starlette.responses import PlainTextResponse
    from starlette.routing import Route

    app = Starlette(routes=[Route("/health", lambda request: PlainTextResponse("ok"))],
                    middleware=[Middleware(GuardAllPaths, key="", opened="", idle_timeout=idle_timeout)])
    port = free_port()
    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=port, log_level="warning", lifespan="on"))
    app.state.server = server
    thread = threading.Thread(target=server.run, daemon=True)
    thread.start()
    deadline = time.monotonic() + 30
    while not server.started and time.monotonic() < deadline:
        time.sleep(0.05)
    try:
        yield port
    finally:
        server.should_exit = True
        thread.join(10)


def closed_by_server(sock: socket.socket, within: float) -> bool:
    sock.settimeout(within)
    try:
        return sock.recv(1) == b""
    except (socket.timeout, ConnectionResetError):
        return False


def test_idle_connections_are_closed_and_busy_ones_are_not():
    with guarded_server(idle_timeout=1.0) as port:
        idle = [socket.create_connection(("127.0.0.1", port)) for _ in range(50)]  # connect, send nothing
        slow = socket.create_connection(("127.0.0.1", port))
        slow.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n")  # a request head that never ends
        started = time.monotonic()
        assert all(closed_by_server(s, 5) for s in [*idle, slow])
        took = time.monotonic() - started
        assert 0.9 <= took <= 4, took  # the timeout plus at most two sweeps
        # a client that keeps asking is served on its one connection throughout
        busy = socket.create_connection(("127.0.0.1", port))
        for _ in range(6):
            busy.sendall(b"GET /health HTTP/1.1\r\nHost: x\r\n\r\n")
            answer = b""
            while not answer.endswith(b"ok"):
                chunk = busy.recv(4096)
                assert chunk, answer  # closed in the middle of a conversation
                answer += chunk
            assert answer.startswith(b"HTTP/1.1 200")
            time.sleep(0.5)
        for s in [*idle, slow, busy]:
            s.close()


# --- sequences per request ----------------------------------------------------------------------------------------
def post(guard: GuardAllPaths, path: str, body: bytes, chunk: int = 7):
    """POST body in small pieces, as uvicorn may deliver it; (status, what the app received or the refusal)."""
    sent, received = [], []
    pieces = [body[i:i + chunk] for i in range(0, len(body), chunk)] or [b""]
    messages = [{"type": "http.request", "body": p, "more_body": i < len(pieces) - 1} for i, p in enumerate(pieces)]

    async def app(scope, receive, send):
        while True:
            message = await receive()
            received.append(message.get("body", b""))
            if not message.get("more_body"):
                break

    async def send(message):
        sent.append(message)

    async def receive():
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    guard.app = app
    scope = {"type": "http", "path": path, "method": "POST", "root_path": "", "headers": []}
    asyncio.run(guard(scope, receive, send))
    if sent:
        return sent[0]["status"], json.loads(sent[1]["body"])
    return 200, b"".join(received)


@pytest.mark.parametrize("prompt,n,allowed", [
    (["Hello"] * 1024, 8, False),  # the 8,192 sequences: each prompt's n 8 was within the bound
    (["Hello"] * 3, 3, False),
    (["Hello"] * 2, 4, True),
    ("Hello", 8, True),
    ("Hello", 9, True),  # one prompt: vLLM's own bound refuses it, with its own message
    (["Hello"], 9, True),
    ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10], 8, True),  # one prompt as token ids
    ([[1, 2], [3, 4], [5]], 3, False),  # three prompts as token ids
])
def test_the_guard_bounds_sequences_per_request_not_per_prompt(prompt, n, allowed):
    guard = GuardAllPaths(None, key="", opened="", max_seqs=8)
    body = json.dumps({"model": "m", "prompt": prompt, "n": n, "max_tokens": 4}).encode()
    status, answer = post(guard, "/v1/completions", body)
    if allowed:
        assert status == 200 and answer == body  # the app reads the body the guard read, whole
    else:
        assert status == 400 and answer["error"]["param"] == "n", answer
        assert f"asks for {len(prompt) * n} sequences" in answer["error"]["message"]
        assert "at most 8 per request (its --max-num-seqs)" in answer["error"]["message"]


def test_the_sequence_bound_comes_from_vllms_own_variable(monkeypatch):
    """One limit: exposure.api_environment sets VLLM_MAX_N_SEQUENCES for vLLM's per-prompt check; the guard reads
    the same variable. Bodies that are not completion requests pass to vLLM, which answers them."""
    monkeypatch.setenv("VLLM_MAX_N_SEQUENCES", "4")
    guard = GuardAllPaths(None, key="", opened="")
    assert post(guard, "/v1/completions", json.dumps({"prompt": ["a"] * 5}).encode())[0] == 400
    assert post(guard, "/v1/completions", b"{not json")[0] == 200
    assert post(guard, "/v1/chat/completions", json.dumps({"prompt": ["a"] * 5}).encode())[0] == 200
    monkeypatch.delenv("VLLM_MAX_N_SEQUENCES")
    assert post(GuardAllPaths(None, key="", opened=""), "/v1/completions",
                json.dumps({"prompt": ["a"] * 5000}).encode())[0] == 200
