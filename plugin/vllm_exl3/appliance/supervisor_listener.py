"""supervisord event listener: when a program goes FATAL, stop supervisord so the container exits.

supervisord keeps running after it gives up on a program (FATAL: it failed to start `startretries` times in a
row), which would leave a container that looks up but serves nothing. Stopping supervisord instead hands the
failure to Docker, whose restart policy and `docker ps` status are what operators watch.

Protocol (supervisor's docs, "Event Listeners"): write READY, read one header line and a payload of `len`
bytes, answer RESULT 2 / OK. stdout is the protocol channel, so messages go to stderr.
"""

from __future__ import annotations

import os
import signal
import sys


def fields(line: str) -> dict[str, str]:
    return dict(token.split(":", 1) for token in line.split())


def main() -> None:
    supervisord = os.getppid()  # supervisord starts its listeners itself
    while True:
        sys.stdout.write("READY\n")
        sys.stdout.flush()
        header = fields(sys.stdin.readline())
        payload = sys.stdin.read(int(header["len"]))
        if header.get("eventname") == "PROCESS_STATE_FATAL":
            name = fields(payload.split("\n", 1)[0]).get("processname", "?")
            print(f"supervisor_listener: program {name} is FATAL (gave up restarting it); stopping supervisord "
                  "so the container exits", file=sys.stderr, flush=True)
            os.kill(supervisord, signal.SIGTERM)
        sys.stdout.write("RESULT 2\nOK")
        sys.stdout.flush()


if __name__ == "__main__":
    main()
