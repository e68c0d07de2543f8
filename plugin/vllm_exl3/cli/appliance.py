"""The appliance's commands: `launch` and `preflight` (the steps, their output and exit codes, then the exec; the
mapping and the checks are appliance/launch.py's) and `metrics` (appliance/metrics/)."""

from __future__ import annotations

import argparse
import os
import shlex
from collections.abc import Mapping
from pathlib import Path

from ..appliance import exposure
from ..appliance import preflight as checks
from ..appliance.container_init import record_exit_status
from ..appliance.launch import (
    APPLIANCE_VARIABLES,
    DEFAULT_MODEL_DIR,
    EXIT_REFUSED,
    ROLES,
    LaunchError,
    available_presets,
    build_spec,
    check_options,
    exec_argv,
    load_preset,
    publish_plan,
    reap_previous,
    replace_pid_file,
    run_preflight,
)
from ..appliance.memory_plan import MemoryFigures
from ..appliance.vllm_options import VllmOptionsError
from ..base import settings


def launch(p: argparse.ArgumentParser):
    """Check the pack, network and memory, then run `vllm serve` for a role (single, head, worker) and preset."""
    _arguments(p)
    return _launch


def _launch(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> int:
    """_run, with the container's record of why this attempt ended (appliance/container_init.py): cleared as it
    starts, its code when it refuses (a vLLM it execs leaves the record empty)."""
    env = dict(os.environ if env is None else env)
    if args.dry_run or args.list_presets:
        return _run(args, env)
    record_exit_status(env, None)
    code = _run(args, env)
    if code:
        record_exit_status(env, code)
    return code


def preflight(p: argparse.ArgumentParser):
    """The checks `launch` runs before starting vLLM (pack, kernel backend, network, head, memory plan), and the
    command it would run; starts nothing. Exit 0 when launch would start, 78 when it would refuse."""
    _arguments(p, preflight_only=True)
    return _run


def metrics(p: argparse.ArgumentParser):
    """Serve the EXL3 and Spark-health metrics for Prometheus (docs/observability.md); runs until stopped."""
    from ..appliance.metrics import exporter

    exporter.add_arguments(p)
    return exporter.run


def _arguments(p: argparse.ArgumentParser, preflight_only: bool = False) -> None:
    """launch's options; preflight_only: `vllm-exl3 preflight` (the same checks, never starts vLLM, role defaults
    to single). vLLM's own extra arguments come after `--` (the CLI puts them in args.vllm_args)."""
    p.add_argument("pack", nargs="?", default=settings.get("VLLM_EXL3_MODEL"),
                   help=f"EXL3 model directory; default $VLLM_EXL3_MODEL, else {DEFAULT_MODEL_DIR} (the container's)")
    default_role = settings.get("VLLM_EXL3_ROLE") or ("single" if preflight_only else None)
    p.add_argument("--role", choices=sorted(ROLES), default=default_role,
                   help="single (one Spark), head or worker (two Sparks); default $VLLM_EXL3_ROLE"
                        + (", else single" if preflight_only else ""))
    p.add_argument("--preset", default=settings.get("VLLM_EXL3_PRESET") or None,
                   help="preset name or .toml file; default $VLLM_EXL3_PRESET, else the role's "
                        "(single: spark-1x, head/worker: spark-2x-tp2)")
    p.add_argument("--list-presets", action="store_true", help="list the presets found and exit")
    if preflight_only:
        p.set_defaults(dry_run=True, no_preflight=False, command_name="preflight")
    else:
        p.add_argument("--dry-run", action="store_true",
                       help="run the preflight, print the command, do not start it (= `vllm-exl3 preflight`)")
        p.add_argument("--no-preflight", action="store_true",
                       help="skip pack/network checks and the memory plan (the preset's flags go to vLLM as they are)")
        p.set_defaults(command_name="launch")
    p.add_argument("--meminfo", metavar="FILE",
                   help="plan against this meminfo file instead of /proc/meminfo, and enforce the plan "
                        "even without a GPU (what-if planning, tests)")
    p.add_argument("--head-wait", type=float, metavar="SECONDS",
                   help="worker: how long to wait for the head's rendezvous port (default $VLLM_EXL3_HEAD_WAIT, "
                        f"else {settings.default('VLLM_EXL3_HEAD_WAIT')}; a dry run does not wait)")


def _run(args: argparse.Namespace, env: Mapping[str, str] | None = None) -> int:
    env = dict(os.environ if env is None else env)
    out = checks.log_stderr
    if args.list_presets:
        for name, path in available_presets(env).items():
            print(f"{name:16} {load_preset(str(path), env).description}")
        return 0
    me = f"vllm-exl3 {getattr(args, 'command_name', 'launch')}"
    if not args.role:
        out(f"{me}: --role (or VLLM_EXL3_ROLE) is required: single, head or worker")
        return 2
    if args.meminfo:
        try:
            MemoryFigures.from_meminfo(args.meminfo)  # read here too: a file that is not one is the user's mistake
        except (OSError, ValueError):
            why = "no such file" if not Path(args.meminfo).is_file() else \
                "not a Linux meminfo file (no MemTotal, MemFree and MemAvailable lines)"
            out(f"{me}: --meminfo {args.meminfo}: {why}. Give a copy of the target machine's /proc/meminfo "
                "(on the Spark: `cat /proc/meminfo > spark.meminfo`).")
            return 2
    if getattr(args, "pack", None):
        env["VLLM_EXL3_MODEL"] = args.pack
    extra = list(getattr(args, "vllm_args", None) or [])
    try:
        head_wait = args.head_wait if args.head_wait is not None else settings.get_float("VLLM_EXL3_HEAD_WAIT", env)
        preset = load_preset(args.preset or ROLES[args.role].default_preset, env)
        spec = build_spec(args.role, preset, env, extra)
    except (LaunchError, settings.SettingError) as e:
        out(f"{me}: {e}")
        return 2
    out(f"{me}: role {spec.role.name}, preset {preset.name} ({preset.path}), pack {spec.model}")
    vllm_env = {k: v for k, v in env.items() if k not in APPLIANCE_VARIABLES}
    # Not skipped by --no-preflight: every later check reads the options as vLLM will, and an option vLLM
    # refuses would only fail after the preflight's minutes anyway.
    try:
        options = spec.read_options(vllm_env)
        check_options(spec, options)
    except VllmOptionsError as e:
        out(f"{me}: REFUSED: {e}")
        return EXIT_REFUSED
    except LaunchError as e:
        out(f"{me}: {e}")
        return 2
    # Not skipped by --no-preflight either: an open API is a safety matter, not a check that might be wrong.
    host = str(options.value("host") or "")
    open_api = None if spec.role.headless else exposure.refusal(host, env, options.value("port"))
    if open_api:
        out(f"{me}: REFUSED: {open_api}")
    elif not spec.role.headless:
        out(f"{me}: {exposure.describe(host, env)}")
    refused = open_api is not None
    if not args.dry_run:  # before the memory plan: it must not count a killed vLLM's engine as taken memory
        reap_previous(env, lambda m: out(f"{me}: {m}"))
    if not args.no_preflight:
        try:
            report, spec = run_preflight(spec, options, env, args.meminfo, None if args.dry_run else head_wait)
        except LaunchError as e:
            out(f"{me}: {e}")
            return 2
        for line in report.lines():
            out(line)
        refused = refused or not report.ok
    argv = spec.argv()
    print(shlex.join(argv), flush=True)
    if refused:
        out(f"{me}: refused before starting vLLM; fix the FAIL/REFUSED lines above"
            + ("" if open_api else " (or pass --no-preflight to `vllm-exl3 launch` to start anyway)"))
        return EXIT_REFUSED
    if args.dry_run:
        return 0
    if not args.no_preflight and report.plan is not None:
        publish_plan(report.plan, env)
    replace_pid_file(env, lambda m: out(f"{me}: {m}"))
    target = exec_argv(argv)
    os.execvpe(target[0], target, vllm_env | exposure.api_environment(options, env))
    return 0  # not reached
