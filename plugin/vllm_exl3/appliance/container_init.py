"""PID 1 of the appliance container: supervisord runs under it, and the container ends with the code of why it ended.

supervisord exits 0 whenever it is stopped, also when the exit-on-fatal listener stops it because vLLM could not be
kept up (supervisor_listener.py). Docker's restart policy, `docker ps` and `docker wait` read the container's exit
code, and a preflight refusal says what kind of failure it is in its code (78, a configuration error). So this
process starts supervisord, passes on the signals Docker and operators send, reaps whatever is re-parented to
PID 1, and exits with the status recorded in EXIT_STATUS_FILE or, when none was (a `docker stop`), supervisord's.

Who records it: the launcher, when it refuses to start vLLM (its own code; it clears the record each time it
starts, so the record is always the last attempt's), and the listener when it gives up (vLLM's exit status where
supervisord knows it: a crash after startsecs; supervisord forgets the status of a start that died sooner, so
there the launcher's record stands, or 1 when the last attempt got as far as vLLM).

    python3 -m vllm_exl3.appliance.container_init -c /etc/vllm-exl3/supervisord.conf   (supervisord's arguments)
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path

from ..base import settings

EXIT_STATUS_FILE = "exit-status"  # in VLLM_EXL3_RUN_DIR
# TERM/INT: stop (docker stop, Ctrl-C); HUP: reload; USR2: reopen logs; QUIT: stop (supervisord's own set)
FORWARDED = (signal.SIGTERM, signal.SIGINT, signal.SIGHUP, signal.SIGQUIT, signal.SIGUSR2)


def exit_status_path(env) -> Path:
    return Path(settings.get("VLLM_EXL3_RUN_DIR", env)) / EXIT_STATUS_FILE


def record_exit_status(env, code: int | None) -> None:
    """Record the code the container is to end with; None clears the record. Outside a container (no run
    directory, or not ours to write) there is nothing to record for."""
    path = exit_status_path(env)
    try:
        if code is None:
            path.unlink(missing_ok=True)
        else:
            path.write_text(f"{code}\n")
    except OSError:
        pass


def recorded_status(env) -> int | None:
    try:
        return int(exit_status_path(env).read_text().strip())
    except (OSError, ValueError):
        return None


def main(argv: list[str] | None = None) -> int:
    env = os.environ
    record_exit_status(env, None)  # a status from an earlier run of this container is not this one's
    supervisord = subprocess.Popen([shutil.which("supervisord") or "supervisord", *(argv or sys.argv[1:])])
    for sig in FORWARDED:
        signal.signal(sig, lambda signum, _frame: supervisord.send_signal(signum))
    status = 1
    while True:
        try:
            pid, wait_status = os.wait()  # any child: orphans re-parented to PID 1 are reaped here too
        except ChildProcessError:
            break
        if pid == supervisord.pid:
            code = os.waitstatus_to_exitcode(wait_status)
            status = code if code >= 0 else 128 - code  # killed by a signal: the shell's convention
            break
    recorded = recorded_status(env)
    return recorded if recorded is not None else status


if __name__ == "__main__":
    sys.exit(main())
