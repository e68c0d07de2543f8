"""The HTTP side: one streaming request to an OpenAI-compatible endpoint (SSE), timed per chunk, and the few plain
GETs the bench needs (`/v1/models`, `/metrics`). aiohttp, the client vLLM's own `vllm bench serve` uses."""

from __future__ import annotations

import asyncio
import json
import os
import time
from dataclasses import dataclass, field

import aiohttp

from .workload import Prompt, Workload

# An error body is quoted up to this many characters (vLLM's JSON error names the problem in its first line).
ERROR_SNIPPET = 300


class EndpointError(Exception):
    """The endpoint cannot be used: it does not answer, refuses, or answers something unusable. The message says
    which URL and what happened, in one line."""


@dataclass
class RequestResult:
    """One measured request. Times are seconds from the request's start (perf_counter), `chunks` holds (time,
    tokens so far) for every chunk that carried tokens, so ITL and decode speed come from the raw record."""

    category: str
    index: int
    max_tokens: int
    ok: bool = False
    error: str | None = None
    started: float = 0.0  # seconds from the phase's start
    ttft_s: float | None = None
    e2e_s: float | None = None
    tokens: int = 0
    prompt_tokens: int | None = None
    finish_reason: str | None = None
    token_counts: str = "chunks"  # "usage": the server's running count per chunk; "chunks": one token per chunk
    chunks: list[tuple[float, int]] = field(default_factory=list)

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["chunks"] = [[round(t, 6), n] for t, n in self.chunks]
        return d


def _payload(workload: Workload, prompt: Prompt, model: str, vllm: bool) -> dict:
    body: dict = {"model": model, "max_tokens": prompt.max_tokens, "temperature": workload.temperature,
                  "seed": workload.seed, "stream": True, "stream_options": {"include_usage": True}}
    if prompt.token_ids is not None:
        body["prompt"] = list(prompt.token_ids)
    elif workload.api == "chat":
        body["messages"] = [{"role": "user", "content": prompt.text}]
    else:
        body["prompt"] = prompt.text
    if vllm:
        # vLLM's extensions (other servers may refuse unknown fields): a fixed output length, and the running token
        # count in every chunk, so a chunk carrying several tokens (speculative decoding) is counted right.
        body["ignore_eos"] = workload.ignore_eos
        body["stream_options"]["continuous_usage_stats"] = True
    return body


def _carries_token(choice: dict) -> bool:
    """Without the server's running count: every chunk of a choice is one token, text or not (a token whose text
    the detokenizer holds back, half a UTF-8 character, comes as an empty chunk), except chat's opening chunk that
    only announces the assistant's role."""
    delta = choice.get("delta")
    if isinstance(delta, dict) and delta.get("role"):
        return bool(delta.get("content") or delta.get("reasoning_content") or delta.get("reasoning"))
    return True


def _why(e: aiohttp.ClientConnectorError) -> str:
    """'connection refused' rather than aiohttp's 'Connect call failed (host, port)'."""
    err = e.os_error
    return os.strerror(err.errno).lower() if err is not None and err.errno else str(err or e)


def error_text(raw: bytes) -> str:
    text = raw.decode("utf-8", "replace").strip()
    try:
        doc = json.loads(text)
        msg = doc.get("error", doc) if isinstance(doc, dict) else doc
        text = msg.get("message", text) if isinstance(msg, dict) else str(msg)
    except ValueError:
        pass
    return " ".join(text.split())[:ERROR_SNIPPET]


async def stream(session: aiohttp.ClientSession, base_url: str, workload: Workload, prompt: Prompt, model: str,
                 vllm: bool, phase_start: float) -> RequestResult:
    """Send one streaming request; never raises for what the server does (the result says ok=False and why)."""
    r = RequestResult(prompt.category, prompt.index, prompt.max_tokens)
    path = "/v1/chat/completions" if workload.api == "chat" and prompt.token_ids is None else "/v1/completions"
    t0 = time.perf_counter()
    r.started = t0 - phase_start
    counted = 0
    last_usage = None
    try:
        async with session.post(base_url + path, json=_payload(workload, prompt, model, vllm)) as resp:
            if resp.status != 200:
                why = error_text(await resp.read())
                r.error = f"HTTP {resp.status} from {base_url}{path}: {why}"
                if path.endswith("/chat/completions") and "chat template" in why.lower():
                    r.error += (" (this model has no chat template: measure it with --api completions, or give the "
                                "server one with --chat-template)")
                return r
            async for raw in resp.content:
                line = raw.decode("utf-8", "replace").strip()
                if not line.startswith("data:"):
                    continue  # blank separators, SSE comments (": ping"), event names
                data = line[len("data:"):].strip()
                if data == "[DONE]":
                    break
                now = time.perf_counter() - t0
                doc = json.loads(data)
                if "error" in doc:
                    r.error = f"{base_url}{path} reported an error mid-stream: {error_text(data.encode())}"
                    return r
                usage = doc.get("usage")
                choices = doc.get("choices") or []
                if choices and choices[0].get("finish_reason"):
                    r.finish_reason = choices[0]["finish_reason"]
                if usage and usage.get("prompt_tokens") is not None:
                    r.prompt_tokens = usage["prompt_tokens"]
                if choices and usage and usage.get("completion_tokens") is not None:
                    r.token_counts = "usage"
                    n = usage["completion_tokens"]
                elif choices and _carries_token(choices[0]):
                    n = counted + 1
                else:
                    n = counted
                if usage:
                    last_usage = usage
                if n > counted:
                    counted = n
                    r.chunks.append((now, n))
        r.e2e_s = time.perf_counter() - t0
    except asyncio.TimeoutError:
        r.error = f"{base_url}{path}: no answer within the request timeout (after {len(r.chunks)} chunks)"
        return r
    except aiohttp.ClientConnectorError as e:
        r.error = f"cannot connect to {base_url}: {_why(e)}"
        return r
    except (aiohttp.ClientError, ConnectionError) as e:
        r.error = (f"{base_url}{path}: the connection broke after {counted} tokens "
                   f"({type(e).__name__}: {e or 'closed'})")
        return r
    except ValueError as e:
        r.error = f"{base_url}{path}: a stream chunk is not JSON ({e})"
        return r
    final = (last_usage or {}).get("completion_tokens")
    r.tokens = int(final) if final is not None else counted
    if not r.chunks:
        r.error = f"{base_url}{path}: the stream ended without a single token"
        return r
    r.ttft_s = r.chunks[0][0]
    r.ok = True
    return r


async def get(session: aiohttp.ClientSession, url: str, timeout: float) -> tuple[int, str]:
    """(status, body) of a GET; EndpointError naming the URL when nothing usable answers."""
    try:
        async with session.get(url, timeout=aiohttp.ClientTimeout(total=timeout)) as resp:
            return resp.status, await resp.text()
    except asyncio.TimeoutError as e:
        raise EndpointError(f"{url}: no answer within {timeout:g} s") from e
    except aiohttp.ClientConnectorError as e:
        raise EndpointError(f"cannot connect to {url}: {_why(e)} (is the server running, and is this its "
                            "address?)") from e
    except (aiohttp.ClientError, ConnectionError) as e:
        raise EndpointError(f"{url}: {type(e).__name__}: {e}") from e
