"""Every metric the exporter serves, in one catalogue (`METRICS`: name, type, labels, meaning), built at scrape
time from the state files (base/state.py), the pack (pack.py) and the GPUs (gpu.py).

Conventions (Prometheus's and vLLM's): the `vllm_exl3_` prefix (never `vllm:`, which vLLM unregisters as its
own), base units in the name (`_bytes`, `_seconds`, `_hertz`, `_celsius`), `_total` for counters, `_info`
gauges = 1 carrying facts as labels. Per-worker series carry `rank` (the tensor-parallel rank) and `role`
(single | head | worker); node-level series get them from the scrape target's labels (deploy/prometheus/).
`vllm_exl3_backend_info{layer_type="linear"|"linear_group"|"moe"|"router_gate", backend, rank}` is read by other
tools: keep it stable.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric

from .gpu import read_gpus
from .pack import pack_summary
from ...base.state import (PEER_FILE, PLAN_FILE, WATCHDOG_FILE, WATCHDOG_STATES, StateError, read_memory_plan,
                           read_peer, read_watchdog, read_worker, worker_files)
from ...base.version import __version__

logger = logging.getLogger(__name__)

WORKER = ("rank", "role")
LAYER = ("layer_type", "variant", "device")  # "linear:mul1:4b:cuda" -> linear, mul1:4b, cuda


@dataclass(frozen=True)
class Spec:
    name: str
    kind: str  # gauge | counter
    labels: tuple[str, ...]
    help: str
    gpu_only: bool = False  # exists only where a GPU (and its tools) is present


_SPECS = [
    Spec("vllm_exl3_exporter_info", "gauge", ("version", "role"), "the exporter is up (1); its version and role"),
    Spec("vllm_exl3_state_file_valid", "gauge", ("file",), "a present state file passed its checks (1) or not (0)"),
    Spec("vllm_exl3_state_file_updated_timestamp_seconds", "gauge", ("file",), "when a state file was last written"),
    # -- per worker rank (integration/telemetry.py) --
    Spec("vllm_exl3_worker_up", "gauge", WORKER, "the worker that wrote the state file is running (1) or gone (0)"),
    Spec("vllm_exl3_backend_info", "gauge", ("layer_type", "backend") + WORKER,
         "1 for each kernel backend serving layers of this type (linear | linear_group | moe | router_gate) now"),
    Spec("vllm_exl3_backend_layers", "gauge", LAYER + ("backend",) + WORKER,
         "layers bound to a backend, per layer variant (codebook:bits) and device"),
    Spec("vllm_exl3_backend_skipped_info", "gauge", LAYER + ("backend", "reason") + WORKER,
         "1 for each backend passed over for a layer variant, with the reason"),
    Spec("vllm_exl3_fallback_layers", "gauge", LAYER + ("backend",) + WORKER,
         "layers served by a later backend although an earlier available one was preferred (it cannot serve "
         "them, or the parity gate failed it)"),
    Spec("vllm_exl3_backend_available", "gauge", ("backend", "reason") + WORKER,
         "1 if a kernel backend can run in this worker, else 0 with the reason"),
    Spec("vllm_exl3_native_build_info", "gauge", ("archs", "version") + WORKER,
         "the native CUDA extension's SASS architectures (archs=\"\" without it)"),
    Spec("vllm_exl3_parity_checks", "gauge", LAYER + ("backend", "result") + WORKER,
         "parity-gate checks per backend and layer variant, by result (pass | fail)", gpu_only=True),
    Spec("vllm_exl3_parity_failed_checks", "gauge", WORKER, "parity-gate checks that failed (0 when all passed)"),
    Spec("vllm_exl3_parity_worst_relative_error", "gauge", LAYER + ("backend",) + WORKER,
         "the largest relative error the parity gate measured against the torch reference", gpu_only=True),
    Spec("vllm_exl3_parity_bound", "gauge", LAYER + ("backend",) + WORKER,
         "the relative-error bound of those checks", gpu_only=True),
    Spec("vllm_exl3_weight_load_seconds", "gauge", WORKER, "wall time of the last weight load (exl3_parallel)"),
    Spec("vllm_exl3_weight_load_bytes", "gauge", WORKER, "bytes read by the last weight load"),
    Spec("vllm_exl3_weight_load_bytes_per_second", "gauge", WORKER, "read throughput of the last weight load"),
    Spec("vllm_exl3_weight_load_wait_seconds", "gauge", WORKER, "time vLLM waited for reads during the last load"),
    Spec("vllm_exl3_weight_load_workers", "gauge", WORKER, "reader threads of the last weight load"),
    Spec("vllm_exl3_weight_load_files", "gauge", WORKER, "files read by the last weight load"),
    Spec("vllm_exl3_weight_load_tensors", "gauge", WORKER, "tensors read by the last weight load"),
    Spec("vllm_exl3_weight_load_direct_io", "gauge", WORKER, "1 if the last load used O_DIRECT for every file"),
    Spec("vllm_exl3_device_allocated_bytes", "gauge", WORKER,
         "GPU memory torch had allocated in the worker once its layers were bound (weights and their buffers)",
         gpu_only=True),
    # -- the launcher's memory plan (appliance/memory_plan.py), per node: it plans where a GPU is visible --
    Spec("vllm_exl3_memory_plan_weights_bytes", "gauge", (), "weights per node, as planned", gpu_only=True),
    Spec("vllm_exl3_memory_plan_kv_bytes", "gauge", (), "memory planned for the KV cache", gpu_only=True),
    Spec("vllm_exl3_memory_plan_kv_tokens", "gauge", (), "tokens of KV cache planned", gpu_only=True),
    Spec("vllm_exl3_memory_plan_max_model_len_tokens", "gauge", (), "the context length the plan chose",
         gpu_only=True),
    Spec("vllm_exl3_memory_plan_gpu_memory_utilization_ratio", "gauge", (), "the --gpu-memory-utilization chosen",
         gpu_only=True),
    # -- the pack (format/summary.py) --
    Spec("vllm_exl3_pack_info", "gauge", ("pack", "architecture", "codebooks", "bits"),
         "the pack being served: name (folder), architecture, codebooks and bit widths present"),
    Spec("vllm_exl3_pack_tensors", "gauge", ("bits", "codebook"), "EXL3 tensors per bit width and codebook"),
    Spec("vllm_exl3_pack_bytes", "gauge", ("group",), "EXL3 bytes per tensor group (experts | dense | head)"),
    Spec("vllm_exl3_pack_bits_per_weight", "gauge", ("group",), "stored bits per weight per tensor group"),
    # -- Spark health beyond the node exporter --
    Spec("vllm_exl3_memory_watchdog_state", "gauge", ("state",), "the memory watchdog's verdict (1 for the current)"),
    Spec("vllm_exl3_memory_watchdog_mem_available_bytes", "gauge", (), "MemAvailable as the watchdog last read it"),
    Spec("vllm_exl3_memory_watchdog_swap_used_bytes", "gauge", (), "swap in use as the watchdog last read it"),
    Spec("vllm_exl3_memory_watchdog_psi_some_avg10_percent", "gauge", (), "memory PSI some avg10, watchdog's reading"),
    Spec("vllm_exl3_memory_watchdog_psi_full_avg10_percent", "gauge", (), "memory PSI full avg10, watchdog's reading"),
    Spec("vllm_exl3_memory_watchdog_soft_floor_bytes", "gauge", (), "MemAvailable below which the watchdog acts"),
    Spec("vllm_exl3_memory_watchdog_hard_floor_bytes", "gauge", (), "MemAvailable below which it stops serving"),
    Spec("vllm_exl3_memory_watchdog_soft_events_total", "counter", (), "times the soft floor was crossed"),
    Spec("vllm_exl3_memory_watchdog_hard_stops_total", "counter", (), "times the watchdog stopped serving"),
    Spec("vllm_exl3_peer_alive", "gauge", ("peer",), "two Sparks: this node sees its peer (1) or not (0)"),
    Spec("vllm_exl3_peer_last_seen_timestamp_seconds", "gauge", ("peer",), "when the peer was last seen"),
    Spec("vllm_exl3_gpu_info", "gauge", ("gpu", "name"), "a GPU of this node (1), named", gpu_only=True),
    Spec("vllm_exl3_gpu_sm_clock_hertz", "gauge", ("gpu", "name"), "GPU SM clock", gpu_only=True),
    Spec("vllm_exl3_gpu_memory_clock_hertz", "gauge", ("gpu", "name"), "GPU memory clock", gpu_only=True),
    Spec("vllm_exl3_gpu_temperature_celsius", "gauge", ("gpu", "name"), "GPU temperature", gpu_only=True),
    Spec("vllm_exl3_gpu_power_watts", "gauge", ("gpu", "name"), "GPU power draw", gpu_only=True),
]
METRICS: dict[str, Spec] = {s.name: s for s in _SPECS}


def markdown_table() -> str:
    """The catalogue as docs/observability.md shows it (a test keeps the two equal)."""
    rows = ["| metric | type | labels | meaning |", "|---|---|---|---|"]
    for s in METRICS.values():
        labels = ", ".join(f"`{label}`" for label in s.labels) or "–"
        rows.append(f"| `{s.name}` | {s.kind} | {labels} | {s.help}{' (GPU hosts only)' if s.gpu_only else ''} |")
    return "\n".join(rows) + "\n"


def split_layer_type(layer_type: str) -> tuple[str, str, str]:
    """kernels/selection.py's "linear:mul1:4b:cuda" -> ("linear", "mul1:4b", "cuda")."""
    kind, _, rest = layer_type.partition(":")
    variant, _, device = rest.rpartition(":")
    return kind, variant, device


class Families:
    """One metric family per catalogued name, created on first use (so an empty family is never exported)."""

    def __init__(self):
        self._families: dict[str, Metric] = {}

    def add(self, name: str, labels: dict[str, str], value: float) -> None:
        spec = METRICS[name]
        if set(labels) != set(spec.labels):
            raise KeyError(f"{name}: labels {sorted(labels)} differ from the catalogue's {sorted(spec.labels)}")
        family = self._families.get(name)
        if family is None:
            cls = CounterMetricFamily if spec.kind == "counter" else GaugeMetricFamily
            family = cls(name.removesuffix("_total") if spec.kind == "counter" else name, spec.help,
                         labels=list(spec.labels))
            self._families[name] = family
        family.add_metric([str(labels[k]) for k in spec.labels], float(value))

    def __iter__(self):
        return iter(self._families.values())


class Exl3Collector:
    """A prometheus_client collector: reads everything afresh at each scrape (files are small; scrapes are slow)."""

    def __init__(self, state_dir: Path, pack_dir: str, role: str):
        self.state_dir, self.pack_dir, self.role = state_dir, pack_dir, role
        self._logged: set[str] = set()

    def _invalid(self, f: Families, error: StateError) -> None:
        f.add("vllm_exl3_state_file_valid", {"file": error.file.name}, 0)
        if str(error) not in self._logged:  # once per distinct problem, not once per scrape
            self._logged.add(str(error))
            logger.warning("metrics: %s", error)

    def collect(self):
        f = Families()
        f.add("vllm_exl3_exporter_info", {"version": __version__, "role": self.role}, 1)
        self._workers(f)
        self._pack(f)
        self._health(f)
        for reading in read_gpus()[0]:
            labels = {"gpu": reading.index, "name": reading.name}
            f.add("vllm_exl3_gpu_info", labels, 1)
            for name, value in (("vllm_exl3_gpu_sm_clock_hertz", reading.sm_clock_hertz),
                                ("vllm_exl3_gpu_memory_clock_hertz", reading.memory_clock_hertz),
                                ("vllm_exl3_gpu_temperature_celsius", reading.temperature_celsius),
                                ("vllm_exl3_gpu_power_watts", reading.power_watts)):
                if value is not None:
                    f.add(name, labels, value)
        yield from f

    def _file_ok(self, f: Families, path: Path, written: float) -> None:
        f.add("vllm_exl3_state_file_valid", {"file": path.name}, 1)
        f.add("vllm_exl3_state_file_updated_timestamp_seconds", {"file": path.name}, written)

    def _workers(self, f: Families) -> None:
        for path in worker_files(self.state_dir):
            try:
                w = read_worker(path)
            except StateError as e:
                self._invalid(f, e)
                continue
            self._file_ok(f, path, w.time)
            # the node's role, which the exporter knows (the launcher keeps VLLM_EXL3_ROLE from vLLM's processes)
            ids = {"rank": str(w.rank), "role": self.role}
            f.add("vllm_exl3_worker_up", ids, int(w.alive))
            if w.alive:
                worker_metrics(f, w.data, ids)

    def _pack(self, f: Families) -> None:
        s = pack_summary(self.pack_dir)
        if s is None:
            return
        codebooks = sorted({k.split()[1] for k in s.bits_histogram})
        bits = sorted({k.split()[0] for k in s.bits_histogram}, key=float)
        f.add("vllm_exl3_pack_info", {"pack": Path(s.path).name, "architecture": s.architecture,
                                      "codebooks": ",".join(codebooks), "bits": ",".join(bits)}, 1)
        for key, n in s.bits_histogram.items():
            b, cb = key.split()
            f.add("vllm_exl3_pack_tensors", {"bits": b, "codebook": cb}, n)
        for group, g in s.groups.items():
            f.add("vllm_exl3_pack_bytes", {"group": group}, g.bytes)
            f.add("vllm_exl3_pack_bits_per_weight", {"group": group}, g.bits_per_weight)

    def _health(self, f: Families) -> None:
        for reader, on, name in ((read_watchdog, watchdog_metrics, WATCHDOG_FILE), (read_peer, peer_metrics, PEER_FILE),
                                 (read_memory_plan, plan_metrics, PLAN_FILE)):
            try:
                value = reader(self.state_dir)
            except StateError as e:
                self._invalid(f, e)
                continue
            if value is not None:
                self._file_ok(f, self.state_dir / name, value.time)
                on(f, value)


def worker_metrics(f: Families, data: dict, ids: dict[str, str]) -> None:
    available = {b["name"] for b in data["backends"] if b["available"]}
    for b in data["backends"]:
        f.add("vllm_exl3_backend_available", {"backend": b["name"], "reason": b["reason"], **ids},
              int(b["available"]))
    f.add("vllm_exl3_native_build_info", {"archs": ",".join(data["native_archs"]),
                                          "version": str(data.get("version", "")), **ids}, 1)
    served = dict(data["served"]) or {d["layer_type"]: d["backend"] for d in data["decisions"]}
    for kind, backend in sorted({(split_layer_type(t)[0], b) for t, b in served.items()}):
        f.add("vllm_exl3_backend_info", {"layer_type": kind, "backend": backend, **ids}, 1)
    layers: dict[tuple, int] = {}
    fallbacks: dict[tuple, int] = {}
    for d in data["decisions"]:
        key = split_layer_type(d["layer_type"]) + (d["backend"],)
        layers[key] = layers.get(key, 0) + d["layers"]
        for s in d["skipped"]:
            f.add("vllm_exl3_backend_skipped_info", {**_layer(key), "backend": s["backend"],
                                                     "reason": s["reason"], **ids}, 1)
        if any(s["backend"] in available for s in d["skipped"]):
            fallbacks[key] = fallbacks.get(key, 0) + d["layers"]
    for key, n in layers.items():
        f.add("vllm_exl3_backend_layers", {**_layer(key), "backend": key[3], **ids}, n)
        f.add("vllm_exl3_fallback_layers", {**_layer(key), "backend": key[3], **ids}, fallbacks.get(key, 0))
    checks = data["parity"]["checks"]
    f.add("vllm_exl3_parity_failed_checks", ids, sum(not c["passed"] for c in checks))
    counts: dict[tuple, int] = {}
    worst: dict[tuple, tuple[float, float]] = {}
    for c in checks:
        key = split_layer_type(c["layer_type"]) + (c["backend"],)
        result = "pass" if c["passed"] else "fail"
        counts[key + (result,)] = counts.get(key + (result,), 0) + 1
        if key not in worst or c["error"] > worst[key][0]:
            worst[key] = (c["error"], c["bound"])
    for key, n in counts.items():
        f.add("vllm_exl3_parity_checks", {**_layer(key), "backend": key[3], "result": key[4], **ids}, n)
    for key, (error, bound) in worst.items():
        f.add("vllm_exl3_parity_worst_relative_error", {**_layer(key), "backend": key[3], **ids}, error)
        f.add("vllm_exl3_parity_bound", {**_layer(key), "backend": key[3], **ids}, bound)
    if data.get("device_allocated_bytes") is not None:
        f.add("vllm_exl3_device_allocated_bytes", ids, data["device_allocated_bytes"])
    load = data.get("load")
    if load:
        for name, value in (("seconds", load["seconds"]), ("bytes", load["bytes"]),
                            ("bytes_per_second", load["bytes"] / load["seconds"] if load["seconds"] > 0 else 0),
                            ("wait_seconds", load["wait_seconds"]), ("workers", load["workers"]),
                            ("files", load["files"]), ("tensors", load["tensors"]),
                            ("direct_io", int(bool(load.get("direct_io"))))):
            f.add(f"vllm_exl3_weight_load_{name}", ids, value)


def _layer(key: tuple) -> dict[str, str]:
    return {"layer_type": key[0], "variant": key[1], "device": key[2]}


def watchdog_metrics(f: Families, w) -> None:
    for state in WATCHDOG_STATES:
        f.add("vllm_exl3_memory_watchdog_state", {"state": state}, int(w.state == state))
    for field in ("mem_available_bytes", "swap_used_bytes", "soft_floor_bytes", "hard_floor_bytes",
                  "soft_events_total", "hard_stops_total"):
        f.add(f"vllm_exl3_memory_watchdog_{field}", {}, getattr(w, field))
    f.add("vllm_exl3_memory_watchdog_psi_some_avg10_percent", {}, w.psi_some_avg10)
    f.add("vllm_exl3_memory_watchdog_psi_full_avg10_percent", {}, w.psi_full_avg10)


def peer_metrics(f: Families, p) -> None:
    f.add("vllm_exl3_peer_alive", {"peer": p.peer}, int(p.alive))
    if p.last_seen is not None:
        f.add("vllm_exl3_peer_last_seen_timestamp_seconds", {"peer": p.peer}, p.last_seen)


def plan_metrics(f: Families, p) -> None:
    f.add("vllm_exl3_memory_plan_weights_bytes", {}, p.weights_bytes)
    f.add("vllm_exl3_memory_plan_kv_bytes", {}, p.kv_bytes)
    f.add("vllm_exl3_memory_plan_kv_tokens", {}, p.kv_tokens)
    f.add("vllm_exl3_memory_plan_max_model_len_tokens", {}, p.max_model_len)
    f.add("vllm_exl3_memory_plan_gpu_memory_utilization_ratio", {}, p.gpu_memory_utilization)
