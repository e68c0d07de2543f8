"""Who can reach the API: the bind address the launcher gives vLLM, and the rule that refuses an open one.

vLLM binds every interface unless told otherwise, and its `--api-key` / `VLLM_API_KEY` guards only paths under
/v1, /v2, /inference and /cohere (vllm/entrypoints/serve/middleware/authenticate.py, GUARDED_PREFIX): /invocations
(which runs completions), /tokenize, /detokenize, /metrics, /ping, /health, /version stay open. So:

- no `VLLM_EXL3_HOST`: loopback (127.0.0.1) without a key, every interface (0.0.0.0) with one;
- a non-loopback bind without a key is refused at launch unless `VLLM_EXL3_ALLOW_OPEN_API=1` says the operator
  means it (a trusted, isolated network);
- the launcher (and `vllm-exl3 serve`) always adds `api_guard.GuardAllPaths` as vLLM middleware: with a key,
  every path needs it except GET/HEAD of `VLLM_EXL3_OPEN_PATHS` (default /health and /metrics, for Docker's
  health check and Prometheus); with or without a key it answers 503 once vLLM is draining and closes
  connections that send no request (VLLM_EXL3_HTTP_IDLE_TIMEOUT);
- one request may ask for at most --max-num-seqs sequences: vLLM's own bound on `n` is 16384 per prompt
  (VLLM_MAX_N_SEQUENCES, vllm/envs.py), and a stream that large starves the API server's event loop, /health
  included, past the health check's timeout. vLLM applies the variable per prompt; the guard applies the same
  value to prompts x n of a whole completion request (api_guard.py).
"""

from __future__ import annotations

import ipaddress
from collections.abc import Mapping

from .memory_plan import Request
from ..base import settings
from .vllm_options import VllmOptions

LOOPBACK_BIND = "127.0.0.1"
ALL_INTERFACES = "0.0.0.0"
GUARD_MIDDLEWARE = "vllm_exl3.appliance.api_guard.GuardAllPaths"


def has_key(env: Mapping[str, str]) -> bool:
    return bool(env.get("VLLM_API_KEY", "").strip())


def open_api_allowed(env: Mapping[str, str]) -> bool:
    return settings.get("VLLM_EXL3_ALLOW_OPEN_API", env).strip().lower() in settings.TRUE


def api_host(env: Mapping[str, str]) -> str:
    """The address vLLM binds: the configured one, else loopback without a key and every interface with one."""
    configured = settings.get("VLLM_EXL3_HOST", env).strip()
    if configured:
        return configured
    return ALL_INTERFACES if has_key(env) else LOOPBACK_BIND


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host.strip("[]")).is_loopback
    except ValueError:
        return False  # a host name: it may resolve to anything


APPLIANCE_LOOPBACK_HINT = "API_HOST=127.0.0.1, VLLM_EXL3_HOST in the container"


def refusal(host: str, env: Mapping[str, str], port: int | str | None = None,
            loopback_hint: str = APPLIANCE_LOOPBACK_HINT) -> str | None:
    """Why this bind must not start, or None. The message says the ways out (loopback_hint: how to bind loopback
    where this runs)."""
    if is_loopback(host) or has_key(env) or open_api_allowed(env):
        return None
    where = "every interface" if host in ("", ALL_INTERFACES, "::") else host
    port = port or settings.get("VLLM_EXL3_PORT", env)
    return (f"the API would listen on {where} with no key: anyone who reaches port {port} could use the model. "
            "Set VLLM_API_KEY (clients send `Authorization: Bearer <key>`), "
            f"or bind loopback ({loopback_hint}), or set ALLOW_OPEN_API=1 (VLLM_EXL3_ALLOW_OPEN_API) on a network you trust")


def describe(host: str, env: Mapping[str, str]) -> str:
    if has_key(env):
        paths = settings.get("VLLM_EXL3_OPEN_PATHS", env, keep_empty=True)
        return f"API on {host}, key required on every path except {paths or 'none'}"
    if is_loopback(host):
        return f"API on {host} (loopback only), no key"
    return f"API on {host} with NO key (VLLM_EXL3_ALLOW_OPEN_API=1)"


def api_environment(options: VllmOptions, env: Mapping[str, str]) -> dict[str, str]:
    """What vLLM's API server needs in its environment to bound one request: at most --max-num-seqs sequences
    (vLLM's default for that, when unset) unless the operator set VLLM_MAX_N_SEQUENCES."""
    if env.get("VLLM_MAX_N_SEQUENCES"):
        return {}
    return {"VLLM_MAX_N_SEQUENCES": str(options.value("max_num_seqs") or Request.max_num_seqs)}
