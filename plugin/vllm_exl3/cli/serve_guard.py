"""The guard `vllm-exl3 serve` starts beside vLLM: once serve is gone, however it went, nothing of vLLM stays.

A `kill -9` of serve leaves it no chance to stop vLLM. The kernel's parent-death signal (SIGTERM, serve.py) reaches
vLLM's API server only, and while it boots vLLM does not act on it: it booted on and served with no parent. The
guard runs in its own session (a Ctrl-C in the terminal is serve's to handle), holds the read end of a pipe whose
write end only serve has, and when that pipe reads EOF (serve exited, the kernel closed its end) it gives vLLM's
process group `grace` seconds to finish the stop it was asked for, then SIGKILLs what is left of it. After an
orderly stop the group is already empty and the guard just exits.

Usage (serve.py): python -m vllm_exl3.cli.serve_guard PGID GRACE_S, stdin the pipe.
"""

from __future__ import annotations

import os
import signal
import sys
import time

from ..appliance.health import group_members


def main(argv: list[str]) -> int:
    pgid, grace = int(argv[1]), float(argv[2])
    for s in (signal.SIGINT, signal.SIGHUP):
        signal.signal(s, signal.SIG_IGN)
    while sys.stdin.buffer.read(65536):  # nothing is ever written: returns b"" once serve is gone
        pass
    deadline = time.monotonic() + grace
    while group_members(pgid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if group_members(pgid):
        print(f"vllm-exl3 serve is gone: vLLM (process group {pgid}) did not stop within {grace:g} s; killing it",
              file=sys.stderr, flush=True)
        try:
            os.killpg(pgid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
