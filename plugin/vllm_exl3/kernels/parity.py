"""The boot-time parity gate: before the server answers, a sample of the model's real layers runs through the
backend chosen for them and through the torch reference (backends/torch_ref.py) on fixed random inputs.

`VLLM_EXL3_PARITY` (read through base/settings.py):
- `fallback` (default): a (backend, layer type) whose error exceeds the bound is excluded (kernels/selection.py)
  and `gate` returns a `Fallback`: the caller (integration/binding.py) binds every layer of that type it had bound
  to the backend again, and selection gives them the next one; the numbers are logged. The gate decides, the
  caller acts: kernels/ never reaches back into the layers.
- `strict`: refuse to start (errors.ParityError), naming the layer, the backend and the error.
- `off`: no checks.

A MoE router's 16-bit gate, when VLLM_EXL3_ROUTER_GATE=1 puts it on a backend, is checked the same way against
the reference's fp32 product (`router_gate_error`).

Which layers: the first layer of each (backend, layer type) — layer types are per codebook and bit width
(selection.py), so every codebook and bit width present is covered, dense and routed experts alike — and every
layer of the model's last block. The torch reference itself is never checked (on CPU it is the only backend, so
the gate costs nothing there). Cost per checked layer: one reference decode of its Ŵ (dense) or of ≤ 4 experts'
Ŵ (routed), plus forwards of 1, 8 and 96 rows (dense) or 64 tokens (routed).

Error: ‖y − y_ref‖ / ‖y_ref‖ (Frobenius, fp32), non-finite output = infinite error. Bounds (`BOUNDS`) are about
3× what the GPU tests observe for the native kernels (tests/kernels/gpu: ≤ 3e-3 fp16, ≤ 1e-2 bf16); a broken
kernel is off by O(1). Results go to the log and to a JSON report per server and rank that `vllm-exl3 info`
shows: `<temp dir>/vllm-exl3-parity/port-<API port>.rank<rank>.json` (`report_path`), or the one file
`VLLM_EXL3_PARITY_REPORT` names.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass
from pathlib import Path

import torch

from ..base import settings
from ..format.jsonfile import write_json
from .backend import get_backend
from .errors import ParityError
from .interface import Backend, BoundLinear, BoundLinearGroup, BoundMoE
from .selection import exclude
from .specs import PROJECTIONS, ExpertStack

logger = logging.getLogger(__name__)

PARITY_ENV = "VLLM_EXL3_PARITY"
REPORT_ENV = "VLLM_EXL3_PARITY_REPORT"
POLICIES = ("fallback", "strict", "off")
REFERENCE = "torch"
BOUNDS = {torch.float16: 1e-2, torch.bfloat16: 3e-2, torch.float32: 1e-2}
LINEAR_ROWS = (1, 8, 96)  # skinny, panel and reconstruct paths of the native kernels
MOE_TOKENS = 64
MOE_MAX_EXPERTS = 4  # experts per checked routed layer (more only to cover every bit width present)
ROUTER_GATE_ROWS = (1, 2, 8, 96)  # the native gate's small_linear (1-2 rows) and its cuBLAS side
SEED = 1234


@dataclass
class Check:
    layer: str
    layer_type: str
    backend: str
    error: float
    bound: float
    passed: bool
    inputs: str
    seconds: float


@dataclass(frozen=True)
class Fallback:
    """The gate's decision under `fallback`: `backend` failed on `layer_type` and selection skips it from now on;
    every layer of that type bound to it must be bound again (selection then gives it the next backend)."""

    layer_type: str
    backend: str
    reason: str


def policy(environ: Mapping[str, str] | None = None) -> str:
    value = settings.get(PARITY_ENV, environ).strip().lower()
    if value not in POLICIES:
        raise settings.SettingError(PARITY_ENV, value, f"one of {', '.join(POLICIES)}")
    return value


REPORT_DIR = "vllm-exl3-parity"  # under the temp dir: one report per server and rank
VLLM_DEFAULT_PORT = 8000  # what vLLM's OpenAI server listens on without --port


def _server_options() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(add_help=False, allow_abbrev=False, exit_on_error=False)
    parser.add_argument("--port", type=int)
    parser.add_argument("--config")
    parser.add_argument("--headless", action="store_true")
    return parser


def server_key(argv: list[str] | None = None) -> str:
    """Which server this process serves, from the server's command line (vLLM starts its engine and worker
    processes with multiprocessing, which hands them the API server's sys.argv): `port-<API port>` for vLLM's
    OpenAI server (`vllm serve`, `python -m vllm.entrypoints.openai.api_server`; --port, else the port of a
    --config file, else vLLM's default), `headless` for a headless node (no API), `offline` for anything else."""
    argv = list(sys.argv if argv is None else argv)
    script = Path(argv[0]) if argv else Path()
    vllm_cli = script.name == "vllm" or script.parts[-4:] == ("vllm", "entrypoints", "cli", "main.py")
    if vllm_cli and argv[1:2] == ["serve"]:
        options = argv[2:]
    elif script.parts[-4:] == ("vllm", "entrypoints", "openai", "api_server.py"):  # python -m sets the full path
        options = argv[1:]
    else:
        return "offline"
    try:
        args, _ = _server_options().parse_known_args(options)
    except argparse.ArgumentError:  # not reached in practice: the server parsed the same line before starting us
        return "port-unknown"
    if args.headless:
        return "headless"
    port = args.port if args.port is not None else _config_port(args.config)
    return f"port-{port if port is not None else VLLM_DEFAULT_PORT}"


def _config_port(config: str | None) -> int | None:
    """The `port` of a `vllm serve --config FILE` (YAML), if it sets one."""
    if not config:
        return None
    import yaml  # vLLM reads --config with PyYAML, one of its dependencies

    try:
        port = (yaml.safe_load(Path(config).read_text()) or {}).get("port")
        return int(port) if port is not None else None
    except (OSError, ValueError, AttributeError, TypeError, yaml.YAMLError):
        return None  # vLLM itself refuses such a file before any layer is bound


def report_dir() -> Path:
    return Path(tempfile.gettempdir()) / REPORT_DIR


def report_path(environ=None, key: str | None = None, rank: int = 0) -> Path:
    """Where this server's rank writes its report: the file VLLM_EXL3_PARITY_REPORT names, else one file per
    server and rank in report_dir()."""
    value = settings.lookup(REPORT_ENV, environ)
    return Path(value) if value else report_dir() / f"{key or server_key()}.rank{rank}.json"


@dataclass
class Report:
    path: Path
    body: dict | None  # None: the file could not be read; `problem` says why
    problem: str = ""


def read_reports(environ=None, port: int | None = None) -> list[Report]:
    """The reports `vllm-exl3 info` shows: the file VLLM_EXL3_PARITY_REPORT names, else every server's in
    report_dir(), by name; only the server on `port`'s when given (by file name, and by the report's own
    `server` where it can be read)."""
    value = settings.lookup(REPORT_ENV, environ)
    if value:
        paths = [Path(value)] if Path(value).exists() else []
    else:
        paths = sorted(report_dir().glob(f"port-{port}.rank*.json" if port is not None else "*.rank*.json"))
    reports = []
    for path in paths:
        try:
            body = json.loads(path.read_text())
            if not isinstance(body, dict):
                raise ValueError(f"a JSON {type(body).__name__}, not an object")
            if port is None or body.get("server") == f"port-{port}":
                reports.append(Report(path, body))
        except (OSError, ValueError) as e:
            reports.append(Report(path, None, f"{type(e).__name__}: {e}"))
    return reports


_lock = threading.RLock()
_checks: list[Check] = []
_verified: set[tuple[str, str]] = set()  # (backend, layer type) checked once (passed or failed)
_served: dict[str, str] = {}  # layer type -> backend (the latest binding)


def reset() -> None:
    """Forget everything (tests)."""
    with _lock:
        _checks.clear()
        _verified.clear()
        _served.clear()


def checks() -> list[Check]:
    with _lock:
        return list(_checks)


def served() -> dict[str, str]:
    """Layer type -> the backend its layers are bound to now (after any fallback the gate caused)."""
    with _lock:
        return dict(_served)


def rel_error(y: torch.Tensor, ref: torch.Tensor) -> float:
    y, ref = y.float(), ref.float()
    if not bool(torch.isfinite(y).all()):
        return float("inf")
    return ((y - ref).norm() / ref.norm().clamp_min(1e-30)).item()


def _randn(shape, dtype, device, generator) -> torch.Tensor:
    return torch.randn(shape, generator=generator, dtype=torch.float32).to(device=device, dtype=dtype)


def _rows_error(call: Callable, ref: Callable, in_features: int, dtype: torch.dtype,
                device: torch.device, row_counts: tuple[int, ...] = LINEAR_ROWS) -> tuple[float, str]:
    """Worst relative error of `call` against `ref` over fixed inputs of `in_features` and each of `row_counts`."""
    g = torch.Generator().manual_seed(SEED)
    worst = 0.0
    for rows in row_counts:
        x = _randn((rows, in_features), dtype, device, g)
        worst = max(worst, rel_error(call(x), ref(x)))
    return worst, "rows " + ",".join(map(str, row_counts))


def linear_error(bound: BoundLinear, in_features: int, dtype: torch.dtype) -> tuple[float, str]:
    """Worst relative error of a bound linear against the torch reference over LINEAR_ROWS fixed inputs."""
    ref = get_backend(REFERENCE).bind_linear(bound.w, bound.in_offset, bound.out_offset, bound.out_features)
    return _rows_error(bound, ref, in_features, dtype, bound.w.trellis.device)


def linear_group_error(group: BoundLinearGroup, dtype: torch.dtype) -> tuple[float, str]:
    """Worst relative error of a grouped call against the torch reference of each shard, side by side."""
    ref = get_backend(REFERENCE).bind_linear_group(
        [get_backend(REFERENCE).bind_linear(w, 0, 0, w.out_padded) for w in group.ws])
    return _rows_error(group, ref, group.ws[0].in_padded, dtype, group.ws[0].trellis.device)


def router_gate_error(backend: Backend, weight: torch.Tensor, out_fp32: bool) -> tuple[float, str]:
    """Worst relative error of a backend's router gate on the layer's own weight against the torch reference, over
    ROUTER_GATE_ROWS fixed inputs."""
    ref = get_backend(REFERENCE)
    return _rows_error(lambda x: backend.router_gate(x, weight, out_fp32),
                       lambda x: ref.router_gate(x, weight, out_fp32), weight.shape[1], weight.dtype, weight.device,
                       ROUTER_GATE_ROWS)


def sample_experts(experts: ExpertStack) -> list[int]:
    """The first and last local expert, then one of each (codebooks, widths) not yet covered."""
    def signature(e: int):
        return tuple((experts.codebook(e, p), experts.words(e, p)) for p in PROJECTIONS)

    n = experts.num_experts
    chosen = list(dict.fromkeys([0, n - 1]))
    seen = {signature(e) for e in chosen}
    for e in range(n):
        if signature(e) not in seen:
            seen.add(signature(e))
            chosen.append(e)
    for e in range(n):  # fill up to MOE_MAX_EXPERTS
        if len(chosen) >= MOE_MAX_EXPERTS:
            break
        if e not in chosen:
            chosen.append(e)
    return sorted(chosen)


def moe_error(bound: BoundMoE, hidden: int, dtype: torch.dtype) -> tuple[float, str]:
    """Relative error of a bound routed-experts layer against the torch reference, MOE_TOKENS fixed tokens routed
    over a sample of the layer's experts (local ids, no expert map; the reference decodes only those)."""
    from .backends.torch_ref import moe_routed_tokens

    experts, call = bound.experts, bound.call
    device = experts.w13_trellis.device
    sample = torch.tensor(sample_experts(experts))
    k = max(1, min(call.top_k or 2, len(sample)))
    g = torch.Generator().manual_seed(SEED)
    order = torch.rand(MOE_TOKENS, len(sample), generator=g).argsort(dim=1)[:, :k]
    ids = sample[order].to(device=device, dtype=torch.int32)
    weights = torch.rand(MOE_TOKENS, k, generator=g).softmax(dim=1).to(device)
    x = _randn((MOE_TOKENS, hidden), dtype, device, g)
    y = bound(x, weights, ids, None)
    y_ref = moe_routed_tokens(x, weights, ids, None, experts, [], call, warn_slow=False)
    return rel_error(y, y_ref), f"{MOE_TOKENS} tokens, top-{k} of experts {sample.tolist()}"


def _rank() -> int:
    return torch.distributed.get_rank() if torch.distributed.is_initialized() else 0


def _write_report() -> None:
    key, rank = server_key(), _rank()
    path = report_path(key=key, rank=rank)
    body = {"server": key, "rank": rank, "pid": os.getpid(), "time": time.time(), "policy": policy(),
            "reference": REFERENCE,
            "bounds": {str(d).replace("torch.", ""): b for d, b in BOUNDS.items()}, "served": dict(_served),
            "checks": [asdict(c) for c in _checks],
            "seconds": round(sum(c.seconds for c in _checks), 4)}
    try:
        write_json(path, body, indent=2, make_parent=True)
    except OSError as e:
        logger.warning("EXL3 parity: could not write the report %s (%s)", path, e)


def gate(layer: str, layer_type: str, backend: Backend, dtype: torch.dtype,
         measure: Callable[[], tuple[float, str]], last_block: bool) -> Fallback | None:
    """Called for a layer right after `backend` was bound to it. `measure()` returns (error, inputs) of that binding
    (linear_error, moe_error). None: the binding stands. A `Fallback`: the backend failed on this layer type and is
    excluded; the caller binds again every layer of the type it had bound to it. Under `strict` a failure raises
    ParityError instead."""
    mode = policy()
    key = (backend.name, layer_type)
    with _lock:
        new_type = _served.get(layer_type) != backend.name
        _served[layer_type] = backend.name
        sample = mode != "off" and backend.name != REFERENCE and (key not in _verified or last_block)
        if not sample:
            if new_type:
                _write_report()
            return None
        _verified.add(key)
    t0 = time.perf_counter()
    error, inputs = measure()
    seconds = time.perf_counter() - t0
    bound = BOUNDS.get(dtype, max(BOUNDS.values()))
    passed = error <= bound
    check = Check(layer, layer_type, backend.name, error, bound, passed, inputs, round(seconds, 4))
    with _lock:
        _checks.append(check)
        _write_report()
    if passed:
        logger.info("EXL3 parity %s (%s) on %s vs %s: rel. error %.2e <= %.0e (%s, %.3f s)", layer, layer_type,
                    backend.name, REFERENCE, error, bound, inputs, seconds)
        return None
    message = (f"layer {layer} ({layer_type}) on the {backend.name} backend differs from the {REFERENCE} "
               f"reference by {error:.3e} relative (bound {bound:g}; {inputs})")
    if mode == "strict":
        raise ParityError(PARITY_ENV, mode, f"EXL3 parity gate: {message}")
    logger.warning("EXL3 parity gate: %s; %s moves to the next backend (%s=strict refuses to start instead)",
                   message, layer_type, PARITY_ENV)
    reason = f"failed the parity gate ({error:.2e} > {bound:g})"
    exclude(backend.name, layer_type, reason)
    return Fallback(layer_type, backend.name, reason)
