"""`vllm-exl3 launch`: a role, a preset and the environment become one `vllm serve` command, checked, then exec'd.

The mapping is data plus pure functions (`load_preset`, `build_spec`, `apply_plan`), so tests check the exact
argv for every role and preset without starting anything. The side effects are here too (`run_preflight`, the
memory plan for the exporter, the pid file the health checks read, `exec_argv`); the `launch` and `preflight`
commands (cli/appliance.py) run them in order and `exec` (the launcher *becomes* vLLM, so supervisord's signals
and exit codes are vLLM's own).

Precedence, lowest first: preset [vllm] table < environment (name, host, port, head address) < role topology
(TP, --nnodes, --node-rank, --headless: not overridable, the two nodes must agree) < memory plan (fills in
--gpu-memory-utilization, caps --max-model-len) < extra arguments (anything after `--`, then
VLLM_EXL3_EXTRA_ARGS), which vLLM reads last and which the plan checks instead of overriding.

What the preset and the extra arguments set is read by vLLM's own parser (vllm_options.py), never by looking for
a flag's name: vLLM accepts `--ho` for `--host` and `-tp` for `--tensor-parallel-size`.
"""

from __future__ import annotations

import os
import shlex
import sys
import time
from collections.abc import Mapping
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

from ..base import settings
from ..base.state import PLAN_FILE, state_file
from ..format.jsonfile import write_json
from . import exposure, preflight
from .health import PID_FILE, stop_leftovers
from .memory_plan import MemoryFigures, Plan, PlanSettings, Request
from .peer import PeerSecretError, peer_secret
from .vllm_options import VllmOptions, read_options

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

# Exit status when preflight refuses (sysexits' EX_CONFIG): the configuration, not the software, must change.
EXIT_REFUSED = 78

DEFAULT_MODEL_DIR = settings.default("VLLM_EXL3_MODEL")  # where compose mounts the pack, read-only
DEFAULT_MASTER_PORT = int(settings.default("VLLM_EXL3_MASTER_PORT"))  # vLLM's own default for --master-port
IMAGE_PRESET_DIR = Path("/etc/vllm-exl3/presets")
PACKAGE_PRESET_DIR = Path(__file__).resolve().parent / "presets"  # package data: in the wheel and the source tree


@dataclass(frozen=True)
class Role:
    """Where this process sits in the deployment. Spark has one GPU, so TP size = number of nodes."""

    name: str
    nnodes: int
    node_rank: int
    headless: bool  # no API server: the worker only runs its TP rank
    default_preset: str


ROLES = {
    "single": Role("single", 1, 0, False, "spark-1x"),
    "head": Role("head", 2, 0, False, "spark-2x-tp2"),
    "worker": Role("worker", 2, 1, True, "spark-2x-tp2"),
}

# Options that belong to the role, never to a preset or the extra arguments: both nodes must be started with the
# same topology. vLLM's names (argparse dests), as its parser reports what each source sets.
TOPOLOGY_OPTIONS = {"tensor_parallel_size", "pipeline_parallel_size", "data_parallel_size", "nnodes", "node_rank",
                    "master_addr", "master_port", "headless", "distributed_executor_backend"}
# Flags the launcher derives from the environment: (variable, flag, only for multi-node, only with an API server).
ENV_FLAGS = (
    ("VLLM_EXL3_SERVED_NAME", "served-model-name", False, True),
    ("VLLM_EXL3_PORT", "port", False, True),
    ("VLLM_EXL3_HEAD_ADDR", "master-addr", True, False),
    ("VLLM_EXL3_MASTER_PORT", "master-port", True, False),
)
PRESET_KEYS = {"description", "nodes", "vllm", "memory", "base"}
# The appliance's own variables, consumed by the launcher, supervisord and the health checks. They are taken out
# of vLLM's environment because vLLM warns about every VLLM_* variable it does not know; the plugin's own
# (VLLM_EXL3_KERNEL, ...) stay.
APPLIANCE_VARIABLES = {s.name for s in settings.SETTINGS if s.area == "appliance"} - {
    "VLLM_EXL3_OPEN_PATHS", "VLLM_EXL3_HTTP_IDLE_TIMEOUT",  # read inside vLLM's API server by api_guard.py
    "VLLM_EXL3_STATE_DIR"}  # vLLM's workers publish their state there (integration/telemetry.py)
# The sources of vLLM options a user writes, as vllm_options.py names them in messages (read in this order).
EXTRA_AFTER_DASHES = "the arguments after `--`"
EXTRA_ENV = "VLLM_EXL3_EXTRA_ARGS (VLLM_EXTRA_ARGS in .env)"


class LaunchError(ValueError):
    """A role/preset/environment combination that cannot be launched; the message says what to change."""


# ---------------------------------------------------------------------------------------------------------------
# Presets
# ---------------------------------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Preset:
    name: str
    path: Path
    description: str
    nodes: int | None  # the topology it is tuned for; None = any
    vllm: dict[str, Any]
    memory: PlanSettings
    memory_table: dict[str, Any] = field(default_factory=dict)  # as written (a preset based on this one starts there)


def preset_dirs(env: Mapping[str, str]) -> list[Path]:
    dirs = [Path(p) for p in settings.get("VLLM_EXL3_PRESET_DIR", env).split(os.pathsep) if p]
    return dirs + [PACKAGE_PRESET_DIR, IMAGE_PRESET_DIR]


def available_presets(env: Mapping[str, str]) -> dict[str, Path]:
    found: dict[str, Path] = {}
    for d in preset_dirs(env):
        for p in sorted(d.glob("*.toml")) if d.is_dir() else []:
            found.setdefault(p.stem, p)
    return found


def load_preset(name_or_path: str, env: Mapping[str, str]) -> Preset:
    """A preset by name (the search path) or .toml file. `base = "NAME"` starts from that preset's tables: the
    `[vllm]` and `[memory]` keys given here replace its keys, `nodes` is its unless given (spec-ngram is spark-1x
    plus the drafts)."""
    return _load_preset(name_or_path, env, ())


def _load_preset(name_or_path: str, env: Mapping[str, str], seen: tuple[Path, ...]) -> Preset:
    path = Path(name_or_path)
    if not (path.suffix == ".toml" and path.is_file()):
        presets = available_presets(env)
        if name_or_path not in presets:
            raise LaunchError(f"no preset {name_or_path!r}; available: {', '.join(sorted(presets)) or 'none'} "
                              f"(searched {', '.join(map(str, preset_dirs(env)))})")
        path = presets[name_or_path]
    try:
        data = tomllib.loads(path.read_text())
    except tomllib.TOMLDecodeError as e:
        raise LaunchError(f"{path}: not valid TOML ({e})") from e
    unknown = set(data) - PRESET_KEYS
    if unknown:
        raise LaunchError(f"{path}: unknown key(s) {', '.join(sorted(unknown))}; known: {', '.join(sorted(PRESET_KEYS))}")
    flags = {k.lstrip("-"): v for k, v in data.get("vllm", {}).items()}
    memory_table, nodes = dict(data.get("memory", {})), data.get("nodes")
    if "base" in data:
        if path.resolve() in seen:
            raise LaunchError(f"{path}: base = {data['base']!r} leads back to this preset")
        base = _load_preset(str(data["base"]), env, (*seen, path.resolve()))
        flags = {**base.vllm, **flags}
        memory_table = {**base.memory_table, **memory_table}
        nodes = base.nodes if nodes is None else nodes
    try:
        memory = PlanSettings.from_table(memory_table)
    except (TypeError, ValueError) as e:
        raise LaunchError(f"{path}: [memory]: {e}") from e
    return Preset(path.stem, path, str(data.get("description", "")), nodes, flags, memory, memory_table)


# ---------------------------------------------------------------------------------------------------------------
# The command
# ---------------------------------------------------------------------------------------------------------------
def render_flags(flags: Mapping[str, Any]) -> list[str]:
    argv: list[str] = []
    for name, value in flags.items():
        if value is None or value is False:
            continue
        argv.append(f"--{name}")
        if value is not True:
            argv.append(f"{value:g}" if isinstance(value, float) else str(value))
    return argv


@dataclass(frozen=True)
class LaunchSpec:
    role: Role
    preset: Preset
    model: str
    flags: dict[str, Any]
    extra_args: list[str] = field(default_factory=list)
    sources: dict[str, list[str]] = field(default_factory=dict)  # where the extra arguments came from, in order

    def argv(self) -> list[str]:
        """The vLLM command line, as a person would type it."""
        return ["vllm", "serve", self.model, *render_flags(self.flags), *self.extra_args]

    def preset_source(self) -> str:
        return f"preset {self.preset.name} ({self.preset.path})"

    def option_groups(self) -> dict[str, list[str]]:
        """The sources of options vLLM's parser reads one by one, to say which sets what (vllm_options.py)."""
        return {self.preset_source(): render_flags(self.preset.vllm), **self.sources}

    def read_options(self, env: Mapping[str, str] | None = None) -> VllmOptions:
        """The whole command, the preset's flags and each source of extra arguments, read by vLLM's parser."""
        return read_options(self.model, self.argv()[3:], self.option_groups(), env)


def build_spec(role_name: str, preset: Preset, env: Mapping[str, str], extra_args: list[str] = ()) -> LaunchSpec:
    if role_name not in ROLES:
        raise LaunchError(f"unknown role {role_name!r}; one of {', '.join(ROLES)}")
    role = ROLES[role_name]
    if preset.nodes is not None and preset.nodes != role.nnodes:
        fitting = [r.name for r in ROLES.values() if r.nnodes == preset.nodes]
        raise LaunchError(f"preset {preset.name} is for {preset.nodes} node(s); role {role.name} runs on "
                          f"{role.nnodes}: use --role {'/'.join(fitting)} or another preset")
    try:
        from_env = shlex.split(settings.get("VLLM_EXL3_EXTRA_ARGS", env))
    except ValueError as e:
        raise LaunchError(f"{EXTRA_ENV}: not valid shell words ({e}): {env['VLLM_EXL3_EXTRA_ARGS']!r}") from None
    sources = {name: args for name, args in ((EXTRA_AFTER_DASHES, list(extra_args)), (EXTRA_ENV, from_env)) if args}

    flags: dict[str, Any] = dict(preset.vllm)
    multi = role.nnodes > 1
    for var, flag, multi_only, api_only in ENV_FLAGS:
        value = settings.lookup(var, env)  # only what is set: vLLM's own defaults are the table's
        if value and (multi or not multi_only) and (not role.headless or not api_only):
            flags[flag] = value
    if not role.headless:
        # Always explicit: vLLM's own default is every interface (exposure.py has the rule).
        flags["host"] = exposure.api_host(env)
        flags["middleware"] = exposure.GUARD_MIDDLEWARE  # the key on every path, 503 while draining, idle timeout
    flags["tensor-parallel-size"] = role.nnodes
    if multi:
        if not settings.get("VLLM_EXL3_HEAD_ADDR", env):
            raise LaunchError(f"role {role.name} needs the head's address: set HEAD_ADDR in .env "
                              "(VLLM_EXL3_HEAD_ADDR in the container), the head's IP on the fabric link")
        try:
            peer_secret(env)  # the heartbeat program needs it too; refusing here says so before a long boot
        except PeerSecretError as e:
            raise LaunchError(f"role {role.name}: {e}") from None
        flags.setdefault("master-port", DEFAULT_MASTER_PORT)
        flags.update({"distributed-executor-backend": "mp", "nnodes": role.nnodes, "node-rank": role.node_rank,
                      "headless": role.headless})
    return LaunchSpec(role, preset, settings.get("VLLM_EXL3_MODEL", env), flags,
                      [a for args in sources.values() for a in args], sources)


def check_options(spec: LaunchSpec, options: VllmOptions) -> None:
    """What only the role may set: a preset or extra arguments that set the topology, in any spelling vLLM
    accepts (`-tp 2`, `--tensor-parallel 2`, a --config file), are refused."""
    for source in (spec.preset_source(), *spec.sources):
        owned = sorted(set(options.set_by(source)) & TOPOLOGY_OPTIONS)
        if owned:
            raise LaunchError(f"{source} set(s) {', '.join(options.flag(d) for d in owned)}: the topology comes "
                              "from --role (single, head, worker), the same on both nodes")


def plan_request(spec: LaunchSpec, options: VllmOptions) -> Request:
    """What the memory plan is asked: the preset's wishes, or the user's explicit values to check."""
    user = options.set_by(*spec.sources)
    length = options.value("max_model_len")
    length = length if isinstance(length, int) and length > 0 else None  # -1 / auto: vLLM's own choice
    return Request(
        tp=spec.role.nnodes,
        max_model_len=length,
        max_model_len_pinned=length is not None and "max_model_len" in user,
        gpu_memory_utilization=user.get("gpu_memory_utilization"),
        kv_cache_memory_bytes=user.get("kv_cache_memory_bytes"),
        enforce_eager=bool(options.value("enforce_eager")),
        kv_cache_dtype=str(options.value("kv_cache_dtype") or "auto"),
        max_num_batched_tokens=int(options.value("max_num_batched_tokens") or Request.max_num_batched_tokens),
        max_num_seqs=int(options.value("max_num_seqs") or Request.max_num_seqs),
    )


def apply_plan(spec: LaunchSpec, max_model_len: int, gpu_memory_utilization: float | None = None,
               kv_cache_memory_bytes: int | None = None, pinned_len: int | None = None) -> LaunchSpec:
    """Put the planned figures into the command (explicit extra arguments still come last and win).

    The long-prefill threshold must not exceed the context vLLM will use (it refuses that): the planned one, or
    `pinned_len` when the user set it.
    """
    flags = dict(spec.flags)
    flags["max-model-len"] = max_model_len
    if gpu_memory_utilization is not None:
        flags["gpu-memory-utilization"] = gpu_memory_utilization
    if kv_cache_memory_bytes:
        flags["kv-cache-memory-bytes"] = kv_cache_memory_bytes
    length = pinned_len or max_model_len
    threshold = flags.get("long-prefill-token-threshold")
    if isinstance(threshold, int) and threshold > length:
        flags["long-prefill-token-threshold"] = length
    return replace(spec, flags=flags)


def exec_argv(argv: list[str]) -> list[str]:
    """The process to exec for a `vllm ...` command line (see vllm_cli: one invocation on GPU and CPU builds)."""
    return [sys.executable, "-m", "vllm_exl3.integration.vllm_cli", *argv[1:]]


# ---------------------------------------------------------------------------------------------------------------
# Preflight + exec
# ---------------------------------------------------------------------------------------------------------------
def run_preflight(spec: LaunchSpec, options: VllmOptions, env: Mapping[str, str], meminfo: str | None,
                  head_wait_s: float | None, root: Path = Path("/")) -> tuple[preflight.Report, LaunchSpec]:
    """head_wait_s: how long a worker waits for the head's rendezvous port; None = do not probe it (a dry run,
    which may well come before the head is up)."""
    report = preflight.Report()
    log = preflight.log_stderr
    pack_check, pack = preflight.check_pack(spec.model)
    report.checks.append(pack_check)
    if (kernel := preflight.check_kernel(env)) is not None:
        report.checks.append(kernel)
    report.checks += preflight.check_network(env, root)
    if spec.role.nnodes > 1:
        head = str(spec.flags["master-addr"])
        port = int(spec.flags["master-port"])
        if spec.role.headless:
            report.checks += preflight.check_head_reachable(head, port, env.get("VLLM_HOST_IP"), head_wait_s, log)
        else:
            report.checks.append(preflight.check_head_is_local(head))
        local = head if not spec.role.headless else env.get("VLLM_HOST_IP") or preflight.route_source(head, port)
        if local:
            report.checks.append(preflight.check_point_to_point(local, head if spec.role.headless else None, root))
    if pack is None:
        return report, spec
    if (speculative := preflight.check_speculative(pack, options.value("speculative_config"),
                                                   options.flag("speculative_config"),
                                                   options.eagle3_target)) is not None:
        report.checks.append(speculative)
    # A length the user set reaches vLLM as it is (a preset's is replaced by the plan's, within the model's maximum)
    model_refusal = options.model_refusal(length_final=plan_request(spec, options).max_model_len_pinned)
    if model_refusal:
        report.checks.append(preflight.Check("vLLM model config", False, model_refusal))
        return report, spec
    if meminfo is None and not preflight.gpu_present(root):
        # vLLM's CPU build sizes its KV cache from VLLM_CPU_KVCACHE_SPACE, not from a memory fraction.
        report.notes.append("no NVIDIA GPU visible: unified-memory plan not enforced; context capped to the "
                            "model's maximum")
        model_max = preflight.pack_max_len(pack)
        request = plan_request(spec, options)
        wanted = [v for v in (request.max_model_len, model_max) if v]
        return report, apply_plan(spec, min(wanted), pinned_len=pinned(request)) if wanted else spec
    mem = MemoryFigures.from_meminfo(meminfo or root / "proc/meminfo")
    request = plan_request(spec, options)
    report.plan = preflight.memory_plan(pack, request, spec.preset.memory, mem, options.value("speculative_config"))
    if not report.plan.fits:
        return report, spec
    return report, apply_plan(spec, report.plan.max_model_len, report.plan.gpu_memory_utilization,
                              report.plan.kv_cache_memory_bytes, pinned(request))


def pinned(request: Request) -> int | None:
    return request.max_model_len if request.max_model_len_pinned else None


def publish_plan(plan: Plan, env: Mapping[str, str]) -> Path | None:
    """The plan for the metrics exporter (base/state.py reads it back; docs/observability.md), written atomically;
    metrics never stop a launch."""
    body = {"time": time.time(), "fits": plan.fits, "gpu_memory_utilization": plan.gpu_memory_utilization,
            "max_model_len": plan.max_model_len, "kv_tokens": plan.kv_tokens, "weights_bytes": plan.weights_bytes,
            "kv_bytes": plan.kv_cache_memory_bytes}
    try:
        return write_json(state_file(PLAN_FILE, env), body, make_parent=True)
    except OSError as e:
        preflight.log_stderr(f"vllm-exl3 launch: cannot write the memory plan for the metrics exporter ({e})")
        return None


def reap_previous(env: Mapping[str, str], log) -> None:
    """Stop what is left of the vLLM the pid file names (health.stop_leftovers): the engine and workers of a
    killed API server hold the weights and the KV cache. Before the preflight, whose memory plan would count that
    memory as taken (and plan a smaller KV cache, or refuse), and before the new vLLM, which would need it twice."""
    run_dir = settings.lookup("VLLM_EXL3_RUN_DIR", env)  # unset (outside the appliance): no pid file
    if not run_dir:
        return
    try:
        previous = int((Path(run_dir) / PID_FILE).read_text())
    except (OSError, ValueError):
        return
    if previous != os.getpid():
        stop_leftovers(previous, log)


def replace_pid_file(env: Mapping[str, str], log) -> None:
    """This process becomes vLLM: its pid goes in the pid file the health checks read, once nothing of the vLLM
    the file named before is left (reap_previous, again: a cheap no-op when the launch already did it)."""
    reap_previous(env, log)
    run_dir = settings.lookup("VLLM_EXL3_RUN_DIR", env)
    if not run_dir:
        return
    Path(run_dir).mkdir(parents=True, exist_ok=True)
    (Path(run_dir) / PID_FILE).write_text(f"{os.getpid()}\n")
