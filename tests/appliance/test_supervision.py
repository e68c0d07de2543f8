"""Restarts that recover and stops that end: the crash policy, the exit-on-fatal listener under the real supervisord
with deploy/supervisord.conf behind the image's entrypoint (container_init; its vllm program swapped for a small
program that crashes, is refused or runs until stopped) and the exit code each ends the container with, and the
liveness monitor against a server whose engine is dead."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

from support.appliance import SUPERVISORD_CONF, appliance_env, required, tail, tool, wait_until
from support.health import DRAINING, http_server, pid_file
from vllm_exl3.appliance.health import monitor
from vllm_exl3.appliance.supervisor_listener import CrashPolicy, Listener

ROOT = Path(__file__).resolve().parents[2]


def test_crash_policy_backs_off_and_gives_up_within_the_window():
    p = CrashPolicy(limit=4, window=100, backoff=2, backoff_max=5)
    assert [p.on_exit(t) for t in (0, 10, 20)] == [2, 4, 5]  # doubling, capped
    assert p.on_exit(30) is None  # the 4th exit within 100 s: a crash loop
    q = CrashPolicy(limit=3, window=100, backoff=2, backoff_max=60)
    assert [q.on_exit(t) for t in (0, 150, 300, 450)] == [2, 2, 2, 2]  # one crash per window: always restarted
    assert q.on_exit(460) == 4 and q.on_exit(470) is None


def test_listener_restarts_exited_vllm_only_and_stops_on_fatal():
    started, stopped, timers = [], [], []
    listener = Listener(CrashPolicy(3, 100, 1, 10), started.append, lambda name: stopped.append(name),
                        clock=iter([0, 5, 6]).__next__, later=lambda d, fn: (timers.append(d), fn()))
    payload = "processname:{} groupname:{} from_state:RUNNING expected:0 pid:42"
    listener.handle("PROCESS_STATE_EXITED", payload.format("rendezvous-watchdog", "rendezvous-watchdog"))
    assert not started  # other programs have their own autorestart
    listener.handle("PROCESS_STATE_EXITED", payload.format("vllm", "vllm"))
    listener.handle("PROCESS_STATE_EXITED", payload.format("vllm", "vllm"))
    assert started == ["vllm", "vllm"] and timers == [1, 2] and not stopped
    listener.handle("PROCESS_STATE_EXITED", payload.format("vllm", "vllm"))
    assert started == ["vllm", "vllm"] and stopped == ["vllm"]  # 3rd exit in the window: give up
    stopped.clear()
    listener.handle("PROCESS_STATE_FATAL", "processname:vllm groupname:vllm from_state:BACKOFF")
    assert stopped == ["vllm"]


# --- the real supervisord ----------------------------------------------------------------------------------------
def config_with_stand_in(tmp_path: Path, command: str, startsecs: int) -> Path:
    """deploy/supervisord.conf with only [program:vllm]'s command and startsecs changed."""
    text = SUPERVISORD_CONF.read_text()
    head, rest = text.split("[program:vllm]", 1)
    section, tail_ = rest.split("\n[", 1)
    section = re.sub(r"(?m)^command=.*$", f"command={command}", section)
    section = re.sub(r"(?m)^startsecs=.*$", f"startsecs={startsecs}", section)
    conf = tmp_path / "supervisord.conf"
    conf.write_text(f"{head}[program:vllm]{section}\n[{tail_}")
    return conf


def python_stand_in(tmp_path: Path, code: str) -> str:
    """The command of a small Python program that writes vLLM's pid file, then runs `code`."""
    script = tmp_path / "stand_in.py"
    script.write_text("import os, sys, time\n"
                      "open(os.environ['VLLM_EXL3_RUN_DIR'] + '/vllm.pid', 'w').write(str(os.getpid()))\n" + code)
    return f"{sys.executable} {script}"


def run_container_init(tmp_path: Path, command: str, startsecs: int, timeout: float = 60, **env_extra: str
                       ) -> tuple[int, str, float]:
    """The image's entrypoint (container_init, then supervisord with the real config) with [program:vllm] running
    `command`: (exit code, log, seconds) once it ends by itself."""
    required("supervisord (PyPI supervisor)", tool("supervisord"))
    conf = config_with_stand_in(tmp_path, command, startsecs=startsecs)
    env = appliance_env("single", tmp_path / "run", **env_extra)
    (tmp_path / "run").mkdir()
    (tmp_path / "run" / "exit-status").write_text("5\n")  # an earlier run's: not this one's code
    log = tmp_path / "supervisord.log"
    start = time.monotonic()
    with open(log, "ab") as out:  # O_APPEND: supervisord reopens /dev/stdout for each program
        proc = subprocess.Popen([sys.executable, "-m", "vllm_exl3.appliance.container_init", "-c", str(conf)],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until("the container's init to exit", lambda: proc.poll() is not None, timeout, log=log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()
    return proc.returncode, log.read_text(), time.monotonic() - start


def test_a_crash_after_startsecs_is_restarted_with_backoff_then_ends_the_container_with_its_code(tmp_path):
    # runs past startsecs (RUNNING), then crashes: supervisord alone would loop
    code, text, took = run_container_init(
        tmp_path, python_stand_in(tmp_path, "print('stand-in up', flush=True); time.sleep(1.5); sys.exit(3)\n"),
        startsecs=1,
        VLLM_EXL3_RESTART_BACKOFF="0.5", VLLM_EXL3_RESTART_BACKOFF_MAX="1", VLLM_EXL3_CRASH_LIMIT="3",
        VLLM_EXL3_CRASH_WINDOW="60", VLLM_EXL3_LIVENESS_INTERVAL="1")
    assert code == 3, text[-3000:]  # the crashing program's own code, not supervisord's 0
    assert text.count("stand-in up") == 3, text[-3000:]  # the first start and two restarts
    assert text.count("success: vllm entered RUNNING state") == 3  # each got past startsecs: supervisord's own retries never apply
    assert "restarting it in 0.5s" in text and "restarting it in 1s" in text
    assert "3 exits within 60s (VLLM_EXL3_CRASH_LIMIT): crash loop, giving up" in text
    assert took < 30, took


def test_a_refused_launch_ends_the_container_with_the_launchers_code_after_supervisords_retries(tmp_path):
    """The real launcher refusing at once (a preset that does not exist: exit 2; the container test's broken pack
    is the same path with the preflight's 78, tests/appliance/test_container_faults.py): supervisord forgets the
    code of a start that died within startsecs, so the launcher's own record is what the container ends with."""
    code, text, _ = run_container_init(tmp_path, "vllm-exl3 launch --role single --preset no-such-preset",
                                       startsecs=60, timeout=120)
    assert code == 2, text[-3000:]
    assert text.count("exited: vllm (exit status 2; not expected)") == 4  # the first start and 3 retries
    assert "program vllm is FATAL" in text


def test_a_stop_ends_the_container_with_supervisords_code(tmp_path):
    """docker stop: SIGTERM to PID 1 reaches supervisord, which stops the program; nothing failed, so 0."""
    required("supervisord (PyPI supervisor)", tool("supervisord"))
    script = tmp_path / "long.py"
    script.write_text("import os, time\n"
                      "open(os.environ['VLLM_EXL3_RUN_DIR'] + '/vllm.pid', 'w').write(str(os.getpid()))\n"
                      "print('stand-in up', flush=True); time.sleep(600)\n")
    conf = config_with_stand_in(tmp_path, f"{sys.executable} {script}", startsecs=1)
    env = appliance_env("single", tmp_path / "run")
    (tmp_path / "run").mkdir()
    log = tmp_path / "supervisord.log"
    with open(log, "ab") as out:
        proc = subprocess.Popen([sys.executable, "-m", "vllm_exl3.appliance.container_init", "-c", str(conf)],
                                env=env, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)
    try:
        wait_until("vllm RUNNING", lambda: "success: vllm entered RUNNING state" in log.read_text(), 30, proc, log)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0, tail(log)
        assert "stopped: vllm (terminated by SIGTERM)" in log.read_text(), tail(log)
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, 9)
            proc.wait()


def test_liveness_monitor_ends_the_box_after_n_failures_in_a_row(tmp_path):
    env = pid_file(tmp_path, os.getpid()) | {"VLLM_EXL3_ROLE": "single", "VLLM_EXL3_LIVENESS_FAILURES": "3"}
    lines, stops = [], []
    with http_server({"/health": (503, b"")}) as port:  # vLLM's answer when its engine is dead
        env["VLLM_EXL3_PORT"] = str(port)
        assert monitor(env, lines.append, lambda: stops.append(1), sleep=lambda s: None, rounds=5) == 1
    assert stops == [1] and len([ln for ln in lines if "liveness failed" in ln]) == 3
    assert "3 of 3 in a row" in lines[2] and "ending the container" in lines[3]
    for answer in ((200, b""), (503, DRAINING)):  # healthy, or draining (an orderly stop): never stopped
        with http_server({"/health": answer}) as port:
            env["VLLM_EXL3_PORT"] = str(port)
            assert monitor(env, lines.append, lambda: stops.append(1), sleep=lambda s: None, rounds=5) == 0
    assert stops == [1]
    # no process at all: supervisord's and the listener's business, not counted
    env = {"VLLM_EXL3_RUN_DIR": str(tmp_path / "none"), "VLLM_EXL3_ROLE": "single", "VLLM_EXL3_LIVENESS_FAILURES": "1"}
    assert monitor(env, lines.append, lambda: stops.append(1), sleep=lambda s: None, rounds=3) == 0


def test_drain_is_bounded_and_shorter_than_every_stop_after_it():
    """preset --shutdown-timeout < supervisord's stopwaitsecs < compose's stop_grace_period."""
    from vllm_exl3.appliance.launch import available_presets, load_preset

    stopwait = int(re.search(r"(?m)^stopwaitsecs=(\d+)", SUPERVISORD_CONF.read_text()).group(1))
    grace = int(re.search(r"stop_grace_period: (\d+)s", (ROOT / "docker-compose.yml").read_text()).group(1))
    for name in available_presets({}):
        drain = load_preset(name, {}).vllm.get("shutdown-timeout")
        assert isinstance(drain, int) and 0 < drain, f"preset {name}: no bounded --shutdown-timeout"
        assert drain + 30 <= stopwait < grace, (name, drain, stopwait, grace)
    assert "autorestart=false" in SUPERVISORD_CONF.read_text().split("[program:vllm]")[1].split("\n[")[0]
