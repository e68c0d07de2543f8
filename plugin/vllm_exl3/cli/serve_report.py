"""What `vllm-exl3 serve` shows of the vLLM it started: the boot phase and the plugin's lines, read from vLLM's log,
and the answers to its smoke requests (one completion, one chat turn)."""

from __future__ import annotations

import json
import re
import time
from dataclasses import dataclass
from pathlib import Path

from ..appliance.vllm_options import VllmOptions
from ..base.http import http_request
from .common import err_console


def has_chat_template(pack: Path, options: VllmOptions) -> bool:
    """Whether a chat request can succeed: a template given to vLLM, or one the pack's tokenizer ships."""
    if options.value("chat_template"):
        return True
    if any((pack / name).is_file() for name in ("chat_template.jinja", "chat_template.json")):
        return True
    try:
        return bool(json.loads((pack / "tokenizer_config.json").read_text()).get("chat_template"))
    except (OSError, ValueError, AttributeError):
        return False


@dataclass
class Answer:
    kind: str  # completion, chat
    text: str | None  # None: the request failed or was skipped; `note` says why
    seconds: float = 0.0
    note: str = ""


def _ask(kind: str, url: str, body: dict, pick, api_key: str | None = None) -> Answer:
    t0 = time.monotonic()
    status, raw = http_request(url, 120, body, api_key)
    if status is None:
        return Answer(kind, None, time.monotonic() - t0, "no answer")
    try:
        doc = json.loads(raw or b"{}")
        if status != 200:
            detail = doc.get("error", {}).get("message", "") if isinstance(doc.get("error"), dict) else ""
            return Answer(kind, None, time.monotonic() - t0, f"HTTP {status}" + (f": {detail}" if detail else ""))
        text = pick(doc)
    except (ValueError, AttributeError, KeyError, IndexError, TypeError) as e:
        return Answer(kind, None, time.monotonic() - t0, f"{type(e).__name__}: {e}")
    return Answer(kind, text, time.monotonic() - t0)


def demo_requests(base: str, model: str, chat: bool = True, api_key: str | None = None) -> list[Answer]:
    """One completion and one chat turn (skipped when the pack has no chat template)."""
    out = [_ask("completion", f"{base}/v1/completions",
                {"model": model, "prompt": "The history of the city", "max_tokens": 24, "temperature": 0},
                lambda r: r["choices"][0]["text"], api_key)]
    if chat:
        out.append(_ask("chat", f"{base}/v1/chat/completions",
                        {"model": model, "max_tokens": 24, "temperature": 0,
                         "messages": [{"role": "user", "content": "Say hello."}]},
                        lambda r: r["choices"][0]["message"]["content"], api_key))
    else:
        out.append(Answer("chat", None, note="skipped: the pack's tokenizer has no chat template "
                                             "(give one with `-- --chat-template FILE`)"))
    return out


# What the log says while vLLM boots, for the progress line: the last marker seen names the phase. The plugin's
# pack line comes from the API server reading the pack's config (milliseconds); what follows is vLLM starting its
# engine process, then its worker, each importing vLLM afresh (most of a CPU boot); weights load after that.
BOOT_PHASES = (
    ("EXL3 pack", "starting vLLM's engine process"),
    ("Initializing a V1 LLM engine", "starting vLLM's model worker"),
    ("Starting to load model", "loading weights"),
    ("Loading weights", "loading weights"),
    ("loaded ", "loading weights"),
    ("KV cache", "sizing the KV cache"),
    ("Starting vLLM API server", "starting the HTTP server"),
    ("Starting vLLM server on", "starting the HTTP server"),
)
_PACK_LINE = re.compile(r"EXL3 pack .*?: (\d+) EXL3 linears \((\d+) routed-expert")
_BACKEND_LINE = re.compile(r"EXL3 (\S+) -> (\S+) backend")


def boot_phase(log_text: str) -> str:
    found, at = "starting vLLM", -1
    for marker, phase in BOOT_PHASES:
        i = log_text.rfind(marker)
        if i > at:
            found, at = phase, i
    return found


def plugin_summary(log_text: str) -> tuple[str | None, dict[str, str]]:
    """From vLLM's log: the plugin's pack line ("57 EXL3 linears, 48 routed-expert") and backend per layer type."""
    m = _PACK_LINE.search(log_text)
    pack = f"{m.group(1)} EXL3 linears ({m.group(2)} routed-expert projections)" if m else None
    return pack, {layer: backend for layer, backend in _BACKEND_LINE.findall(log_text)}


def log_tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return ""


def progress_printer(log_path: Path):
    """progress(elapsed) while booting: one line, rewritten in place on a terminal, every 15 s otherwise;
    progress(None) ends it."""
    state = {"last": -1e9, "shown": False}

    def progress(elapsed: float | None) -> None:
        tty = err_console.is_terminal
        if elapsed is None:
            if state["shown"] and tty:
                err_console.file.write("\n")
                err_console.file.flush()
            return
        if not tty and elapsed - state["last"] < 15:
            return
        state["last"], state["shown"] = elapsed, True
        try:
            phase = boot_phase(log_path.read_text(errors="replace"))
        except OSError:
            phase = "starting vLLM"
        line = f"booting  {elapsed:4.0f} s: {phase}"
        if tty:
            err_console.file.write("\r" + line.ljust(60))
            err_console.file.flush()
        else:
            err_console.print(line, highlight=False)

    return progress
