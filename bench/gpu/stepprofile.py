"""Where a served decode step's device time goes, by kernel and by kernel class (issue #30: "batch 32 and 64
reported with where the time goes (per-kernel device times)").

A server started with vLLM's torch profiler (`profiler_flags`) is profiled one window per concurrency: POST
/start_profile (with a prefix naming the window), `concurrency` completions of `tokens` tokens at once, POST
/stop_profile. The traces vLLM writes for that window are read back and their events of one category (device
kernels on a GPU, operators on vLLM's CPU build) summed per kernel name and per class (CLASSES, first match wins),
then divided by the engine steps the server counted over the window (`vllm:iteration_tokens_total`, /metrics).
Kernel times are exclusive (`exclusive`): a kernel launched early by programmatic dependent launch does not count
the time it waits for the one before it, so the classes add up to the time the device was busy.

    python3 bench/gpu/stepprofile.py URL MODEL TRACE_DIR [--concurrency 1,8,32,64] [--tokens 64]   (prints JSON)

The server must have been started with `profiler_flags(TRACE_DIR)`. A window holds each request's prefill step as
well (prompts of a few tokens, so it costs little) and the profiler's own overhead on the host: the kernel times are
the device's, the window's wall time is not a clean step time. Kernels replayed from CUDA graphs reach the trace
through CUPTI like any other kernel: an empty `by_class` on a GPU says that assumption failed.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
import threading
import time
import urllib.request
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugin"))

from vllm_exl3.servebench import server_metrics  # noqa: E402

# Kernel classes by name (regular expressions, case-insensitive, first match wins). Our kernels' names are in csrc/;
# the rest are the families vLLM's Hopper build runs for these models. `top` in each window lists the largest
# kernels by name, so a kernel that lands in "other" is visible.
CLASSES = [
    ("compiled elementwise (triton)", r"^triton_"),  # inductor names them after the ops they fuse: before the rest
    ("exl3 moe gemm", r"moe_gemm_kernel"),
    ("exl3 moe route/transforms/reduce", r"moe_(route|gather|act|reduce)_kernel"),
    ("exl3 dense", r"skinny_kernel|panel_kernel|input_transform_kernel|reconstruct\w*_kernel"),
    ("exl3 router gate (small_linear)", r"small_linear_kernel"),  # VLLM_EXL3_ROUTER_GATE=1; else a cuBLAS gemm
    ("exl3 op (cpu)", r"vllm_exl3::"),
    ("vllm gptq moe (humming)", r"humming|process_input_kernel|moe_fused_mul_sum"),
    ("marlin moe", r"marlin.*moe|moe.*marlin"),
    ("marlin / gptq dense", r"marlin|gptq|machete"),
    ("routing simulation (bench only)", r"distribution_elementwise"),  # plan.toml's uniform random routing
    ("moe routing (vllm)", r"topk|top_k|bitonicsort|moe_align|moe_sum|count_and_sort|fused_moe"),
    ("attention", r"flash|fmha|attn|attention|paged|reshape_and_cache"),
    ("gemm (cublas/cutlass)", r"gemm|xmma|nvjet|cutlass|cublas|sm90_"),
    ("compiled elementwise (triton)", r"triton"),
    ("sampling/logits", r"sampl|softmax|argmax|logit"),
]
_COMPILED = [(name, re.compile(rx, re.IGNORECASE)) for name, rx in CLASSES]
TOP = 25  # kernels listed by name in each window


def profiler_flags(trace_dir: Path) -> list[str]:
    """`vllm serve` flags that enable its torch profiler into trace_dir (inactive until /start_profile)."""
    return ["--profiler-config", json.dumps({"profiler": "torch", "torch_profiler_dir": str(trace_dir),
                                             "torch_profiler_with_stack": False})]


def classify(name: str) -> str:
    return next((cls for cls, rx in _COMPILED if rx.search(name)), "other")


def read_trace(path: Path) -> list[dict]:
    raw = path.read_bytes()
    data = json.loads(gzip.decompress(raw) if raw[:2] == b"\x1f\x8b" else raw)
    return data.get("traceEvents", []) if isinstance(data, dict) else data


def exclusive(events: list[dict]) -> list[tuple[str, float, float]]:
    """(name, inclusive µs, exclusive µs) of each event. Exclusive: the part of the event no earlier event of the same
    (pid, tid) — a GPU stream — already covers. Kernels launched with programmatic dependent launch (PDL: ours, and
    some of vLLM's) start while the previous kernel still runs and wait for it inside, so their inclusive durations
    overlap and sum to more than the stream was busy; the exclusive ones sum to exactly the busy time, the overlap
    going to the kernel that was running."""
    out = []
    streams: dict[tuple, list[dict]] = {}
    for e in events:
        streams.setdefault((e.get("pid"), e.get("tid")), []).append(e)
    for evs in streams.values():
        busy_until = float("-inf")
        for e in sorted(evs, key=lambda e: float(e.get("ts", 0.0))):
            t0, dur = float(e.get("ts", 0.0)), float(e["dur"])
            out.append((e.get("name", "?"), dur, max(0.0, t0 + dur - max(t0, busy_until))))
            busy_until = max(busy_until, t0 + dur)
    return out


def summarize(events: list[dict], steps: int, category: str) -> dict:
    """µs per engine step of the complete events of `category` (device kernels: exclusive of overlap on their stream,
    `exclusive`), by class and by name (the largest TOP); the inclusive sums beside them."""
    chosen = [e for e in events
              if e.get("ph") == "X" and e.get("cat") == category and isinstance(e.get("dur"), (int, float))]
    by_name: dict[str, list[float]] = {}  # name -> [calls, inclusive, exclusive]
    # Operators on a CPU nest (a parent's time holds its children's), so there the inclusive times are kept as they are.
    timed = exclusive(chosen) if category == "kernel" else [(e.get("name", "?"), e["dur"], e["dur"]) for e in chosen]
    for name, inc, exc in timed:
        acc = by_name.setdefault(name, [0, 0.0, 0.0])
        acc[0] += 1
        acc[1] += inc
        acc[2] += exc
    per_step = max(steps, 1)
    by_class: dict[str, float] = {}
    for name, (_, _, exc) in by_name.items():
        cls = classify(name)
        by_class[cls] = by_class.get(cls, 0.0) + exc / per_step
    top = sorted(by_name.items(), key=lambda kv: -kv[1][2])[:TOP]
    inclusive = sum(acc[1] for acc in by_name.values()) / per_step
    return {"category": category, "steps": steps, "events": sum(acc[0] for acc in by_name.values()),
            "us_per_step": sum(by_class.values()), "inclusive_us_per_step": inclusive,
            "by_class_us_per_step": dict(sorted(by_class.items(), key=lambda kv: -kv[1])),
            "top": [{"name": n[:160], "class": classify(n), "calls": int(acc[0]), "us_per_step": acc[2] / per_step,
                     "inclusive_us_per_step": acc[1] / per_step} for n, acc in top]}


def _post(url: str, body: dict | None, timeout: float) -> bytes:
    data = json.dumps(body).encode() if body is not None else b""
    req = urllib.request.Request(url, data=data, method="POST", headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=timeout) as r:
        return r.read()


def _scrape(url: str) -> server_metrics.Snapshot:
    with urllib.request.urlopen(url + "/metrics", timeout=10) as r:
        return server_metrics.parse(r.read().decode())


def _completions(url: str, model: str, concurrency: int, tokens: int, timeout: float) -> list[str]:
    """`concurrency` completions at once, each exactly `tokens` tokens; the errors, if any."""
    errors: list[str] = []

    def one(i: int) -> None:
        body = {"model": model, "prompt": f"Request {i}: write a long story.", "max_tokens": tokens,
                "temperature": 0, "ignore_eos": True}
        try:
            out = json.loads(_post(url + "/v1/completions", body, timeout))
            if out["usage"]["completion_tokens"] != tokens:
                errors.append(f"request {i}: {out['usage']['completion_tokens']} tokens, asked {tokens}")
        except Exception as e:  # noqa: BLE001  (reported in the window's row, never raised)
            errors.append(f"request {i}: {e}")

    threads = [threading.Thread(target=one, args=(i,)) for i in range(concurrency)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return errors


def _traces(trace_dir: Path, prefix: str) -> list[Path]:
    # torch's trace handler names them WORKER.TIME.pt.trace.json[.gz]; vLLM writes its own tables (.txt) beside them
    return sorted(p for p in trace_dir.rglob(f"{prefix}*.pt.trace.json*") if p.is_file())


def _new_traces(trace_dir: Path, prefix: str, wait_s: float) -> list[Path]:
    """The trace files of one window (their names start with its prefix), once they stop growing."""
    deadline, last = time.monotonic() + wait_s, None
    while time.monotonic() < deadline:
        sizes = [(p, p.stat().st_size) for p in _traces(trace_dir, prefix)]
        if sizes and sizes == last:
            return [p for p, _ in sizes]
        last = sizes
        time.sleep(1.0)
    return _traces(trace_dir, prefix)


def window(url: str, model: str, trace_dir: Path, concurrency: int, tokens: int, category: str = "kernel",
           timeout: float = 300.0) -> dict:
    """One profiled window: its steps, wall time, and the summary of its traces (`error` when something failed)."""
    prefix = f"c{concurrency}-{time.time_ns()}"
    row: dict = {"concurrency": concurrency, "tokens": tokens, "prefix": prefix}
    _completions(url, model, 1, 4, timeout)  # one unmeasured request: nothing left to compile or allocate
    _post(url + "/start_profile", {"profile_prefix": prefix}, timeout)
    try:
        before = _scrape(url)
        t0 = time.perf_counter()
        errors = _completions(url, model, concurrency, tokens, timeout)
        row["wall_s"] = time.perf_counter() - t0
        after = _scrape(url)
    finally:
        _post(url + "/stop_profile", None, timeout)
    phase = server_metrics.difference(before, after, row["wall_s"])
    row["steps"] = phase.steps if phase else 0
    row["server_ms_per_step"] = phase.ms_per_step if phase else None
    if errors:
        row["error"] = "; ".join(errors[:4])
    files = _new_traces(trace_dir, prefix, 120.0)
    row["traces"] = [str(p) for p in files]
    if not files:
        row["error"] = row.get("error") or f"no trace named {prefix}* in {trace_dir}"
        return row
    events = [e for p in files for e in read_trace(p)]
    row.update(summarize(events, row["steps"], category))
    return row


def profile(url: str, model: str, trace_dir: Path, concurrency: list[int], tokens: int,
            category: str = "kernel") -> list[dict]:
    rows = []
    for c in concurrency:
        try:
            rows.append(window(url, model, trace_dir, c, tokens, category))
        except Exception as e:  # noqa: BLE001  (one window's failure is its row; the next still runs)
            rows.append({"concurrency": c, "tokens": tokens, "error": f"{type(e).__name__}: {e}"})
    return rows


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("url")
    ap.add_argument("model")
    ap.add_argument("trace_dir", type=Path)
    ap.add_argument("--concurrency", default="1,8,32,64")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--category", default="kernel", help="trace event category: kernel (GPU) or cpu_op (CPU)")
    a = ap.parse_args()
    rows = profile(a.url.rstrip("/"), a.model, a.trace_dir, [int(c) for c in a.concurrency.split(",")], a.tokens,
                   a.category)
    print(json.dumps(rows, indent=1))
    return 0 if all("error" not in r for r in rows) else 1


if __name__ == "__main__":
    sys.exit(main())
