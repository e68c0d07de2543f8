"""EXL3 dense-linear kernels side by side on one GPU: ours (native) vs ExLlamaV3 vs bf16 cuBLAS vs the floors.

    PYTHONPATH=plugin[:<exllamav3 site>] python bench/kernels.py [--exllamav3] [--quick] [--out FILE.json]

Method (bench/NOTES.md, "Method"): weights rotated over enough random copies that the L2 cannot
hold them; each call timed with CUDA events while the GPU works through a queue filled behind a sleep kernel (so
host launch overhead is not measured); medians of --iters calls after warm-up. Floors: bytes moved at the measured
device-to-device copy bandwidth, and FLOPs at the measured bf16 cuBLAS rate of the same shape. Prints a table and
writes everything to JSON (bench/results/<gpu>-kernels.json).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import math
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugin"))

from vllm_exl3.format.constants import CODEBOOKS, TILE# noqa: E402
from vllm_exl3.format.tensors import Exl3Weights
from vllm_exl3.kernels.backend import get_backend  # noqa: E402

get_backend("torch")
from vllm_exl3.kernels.backends import native  # noqa: E402
from vllm_exl3.kernels.backends.native import NativePath  # noqa: E402

DEV = "cuda"
L2_DEFEAT_BYTES = 256 << 20  # rotate weight copies until this many bytes are in play (H200 L2: 60 MB)


def random_linear(k: int, n: int, bits: float, codebook: str, seed: int) -> Exl3Weights:
    g = torch.Generator(device=DEV).manual_seed(seed)
    trellis = torch.randint(-(2**15), 2**15, (k // TILE, n // TILE, round(bits * TILE)), dtype=torch.int16,
                            device=DEV, generator=g)
    suh = ((torch.rand(k, device=DEV, generator=g) * 0.5 + 0.75) / math.sqrt(k)
           * (torch.randint(0, 2, (k,), device=DEV, generator=g) * 2 - 1)).half()
    svh = ((torch.rand(n, device=DEV, generator=g) * 0.5 + 0.75)
           * (torch.randint(0, 2, (n,), device=DEV, generator=g) * 2 - 1)).half()
    return Exl3Weights(trellis, suh, svh, codebook, bits)


def time_calls(fns, iters: int, warmup: int = 3) -> float:
    """Median GPU time of one call in µs; fns are rotated (one weight copy each)."""
    for _ in range(warmup):
        for f in fns:
            f()
    torch.cuda.synchronize()
    starts = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    ends = [torch.cuda.Event(enable_timing=True) for _ in range(iters)]
    torch.cuda._sleep(20_000_000)  # ~10 ms: the host enqueues everything below before the GPU gets there
    for i in range(iters):
        starts[i].record()
        fns[i % len(fns)]()
        ends[i].record()
    torch.cuda.synchronize()
    return statistics.median(s.elapsed_time(e) for s, e in zip(starts, ends)) * 1000.0


def save_result(result: dict, out: str | None, name: str) -> Path:
    """Write a bench's JSON to `out`, or to bench/results/<gpu>-<name>.json."""
    gpu = torch.cuda.get_device_name()
    path = Path(out or f"bench/results/{gpu.replace(' ', '-').lower()}-{name}.json")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(result, indent=1))
    return path


def copy_bandwidth() -> float:
    """Device-to-device copy, bytes read + written per second."""
    a = torch.empty(1 << 30, dtype=torch.uint8, device=DEV)
    b = torch.empty_like(a)
    t = time_calls([lambda: b.copy_(a)], iters=20)
    return 2 * a.numel() / (t * 1e-6)


class Case:
    def __init__(self, k, n, bits, codebook):
        self.k, self.n, self.bits, self.codebook = k, n, bits, codebook
        self.weight_bytes = k * n * bits / 8 + 2 * (k + n)
        copies = max(2, math.ceil(L2_DEFEAT_BYTES / self.weight_bytes))
        self.ws = [random_linear(k, n, bits, codebook, seed=s) for s in range(copies)]

    @property
    def name(self) -> str:
        return f"{self.k}x{self.n} {self.bits:g}b {self.codebook}"


@contextlib.contextmanager
def env_set(env: dict[str, str] | None):
    """These environment variables set for the calls inside, restored after (the kernels read theirs per call)."""
    old = {k: os.environ.get(k) for k in (env or {})}
    os.environ.update(env or {})
    try:
        yield
    finally:
        for k, v in old.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def bench_native(case: Case, rows: int, iters: int, path: int = NativePath.AUTO, env: dict | None = None) -> float:
    x = torch.randn(rows, case.k, device=DEV, dtype=torch.float16)
    with env_set(env):
        return time_calls([lambda w=w: native.linear(x, w, 0, 0, case.n, path) for w in case.ws], iters)


def bench_group(spec: str, rows_list: list[int], iters: int) -> None:
    """--group K,N1/N2/..,BITS,CB: one native_linear_group call (csrc/bindings.cpp: two launches for all shards up to
    8 rows) against one native_linear per shard and torch.cat (what integration/linear.py does now), same weights
    rotated over L2_DEFEAT_BYTES of copies; prints one JSON line per row count."""
    k, ns, bits, cb = spec.split(",")
    k, outs, bits = int(k), [int(v) for v in ns.split("/")], float(bits)
    group_bytes = sum(k * n * bits / 8 + 2 * (k + n) for n in outs)
    copies = max(2, math.ceil(L2_DEFEAT_BYTES / group_bytes))
    groups = [[random_linear(k, n, bits, cb, seed=10 * c + i) for i, n in enumerate(outs)] for c in range(copies)]
    for rows in rows_list:
        x = torch.randn(rows, k, device=DEV, dtype=torch.float16)
        grouped = time_calls([lambda ws=ws: native.linear_group(x, ws) for ws in groups], iters)
        separate = time_calls([lambda ws=ws: torch.cat([native.linear(x, w, 0, 0, w.out_padded) for w in ws], 1)
                               for ws in groups], iters)
        print(json.dumps({"group": [k, outs], "bits": bits, "codebook": cb, "rows": rows, "grouped_us": grouped,
                          "separate_us": separate}), flush=True)


def bench_exllamav3(case: Case, rows: int, iters: int, layers) -> float:
    x = torch.randn(rows, case.k, device=DEV, dtype=torch.float16)
    return time_calls([lambda layer=layer: layer.forward(x, {}) for layer in layers], iters)


def bench_bf16(k: int, n: int, rows: int, iters: int) -> float:
    copies = max(1, math.ceil(L2_DEFEAT_BYTES / (2 * k * n)))
    ws = [torch.randn(k, n, device=DEV, dtype=torch.bfloat16) for _ in range(copies)]
    x = torch.randn(rows, k, device=DEV, dtype=torch.bfloat16)
    return time_calls([lambda w=w: torch.matmul(x, w) for w in ws], iters)


def profile_kernels(exllamav3: bool = False) -> list[dict]:
    """Kernel-by-kernel device time of single calls (which launch costs what), via torch.profiler (CUPTI); with
    `exllamav3`, ExLlamaV3's kernels too on the 4096-row cases where it takes less time than ours."""
    from torch.profiler import ProfilerActivity, profile

    def record(prof, case, rows, impl):
        for ev in prof.key_averages():
            if ev.device_type.name == "CUDA" and ev.count:
                entry = {"impl": impl, "case": case.name, "rows": rows, "kernel": ev.key[:90],
                         "us": ev.device_time_total / ev.count, "count": ev.count}
                out.append(entry)
                print(json.dumps(entry), flush=True)

    out = []
    for k, n, bits, cb, rows, path in [(4096, 14336, 4, "mul1", 1, NativePath.AUTO),
                                       (4096, 14336, 4, "mul1", 8, NativePath.AUTO),
                                       (4096, 14336, 2, "mul1", 1, NativePath.AUTO),
                                       (4096, 14336, 4, "mcg", 1, NativePath.AUTO),
                                       (4096, 14336, 4, "mul1", 512, NativePath.AUTO),
                                       (4096, 14336, 4, "mul1", 4096, NativePath.AUTO),
                                       (14336, 4096, 4, "mul1", 4096, NativePath.AUTO),
                                       (2048, 768, 4, "mul1", 4096, NativePath.AUTO),
                                       (4096, 14336, 4, "mul1", 4096, NativePath.RECON_ORIGINAL),
                                       (14336, 4096, 4, "mul1", 4096, NativePath.RECON_ORIGINAL)]:
        case = Case(k, n, bits, cb)
        x = torch.randn(rows, k, device=DEV, dtype=torch.float16)
        for w in case.ws:
            native.linear(x, w, 0, 0, n, path)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for w in case.ws[:4]:
                native.linear(x, w, 0, 0, n, path)
            torch.cuda.synchronize()
        record(prof, case, rows, "native" if path == NativePath.AUTO else f"native path {int(path)}")
        if exllamav3 and rows == 4096 and n <= 4096:
            from vllm_exl3.kernels.backends.exllamav3 import make_layer
            layers = [make_layer(w) for w in case.ws[:4]]
            for layer in layers:
                layer.forward(x, {})
            torch.cuda.synchronize()
            with profile(activities=[ProfilerActivity.CUDA]) as prof:
                for layer in layers:
                    layer.forward(x, {})
                torch.cuda.synchronize()
            record(prof, case, rows, "exllamav3")
            del layers
        del case
    return out


def trace_skinny(spec: str) -> dict:
    """Per-warp timeline of one skinny launch (the native_linear_traced op): where the kernel's time goes."""
    k, n, bits, cb, rows = spec.split(",")
    case = Case(int(k), int(n), float(bits), cb)
    x = torch.randn(int(rows), int(k), device=DEV, dtype=torch.float16)
    for w in case.ws[1:]:
        native.linear(x, w, 0, 0, int(n))
    torch.cuda.synchronize()
    _, t = torch.ops.vllm_exl3.native_linear_traced(x, *native.linear_args(case.ws[0], 0, 0, int(n), 0))
    t = t.cpu().double()  # [blocks, warps, {smid, entry, data, loop end, exit}]
    if t.shape[0] == 0:
        raise SystemExit(f"--trace {spec}: the call took no skinny launch (the planner chose another path)")
    t0 = t[..., 1].min()
    phases = {"start": t[..., 1] - t0, "prologue": t[..., 2] - t[..., 1], "loop": t[..., 3] - t[..., 2],
              "epilogue": t[..., 4] - t[..., 3], "end": t[..., 4] - t0}
    out = {"case": case.name, "rows": int(rows), "blocks": t.shape[0], "span_us": float((t[..., 4].max() - t0) / 1e3)}
    for name, v in phases.items():
        q = torch.quantile(v.flatten() / 1e3, torch.tensor([0.0, 0.1, 0.5, 0.9, 1.0], dtype=torch.float64))
        out[name + "_us"] = [round(float(e), 2) for e in q]  # min, p10, median, p90, max
    sm_end = {}
    for b in range(t.shape[0]):
        sm = int(t[b, 0, 0])
        sm_end[sm] = max(sm_end.get(sm, 0.0), float(t[b, :, 4].max() - t0) / 1e3)
    ends = sorted(sm_end.values())
    out["sm_end_us"] = [round(ends[0], 2), round(ends[len(ends) // 2], 2), round(ends[-1], 2)]
    print(json.dumps(out), flush=True)
    return out


def floor_us(case: Case, rows: int, bw: float) -> float:
    return (case.weight_bytes + 2 * rows * (case.k + case.n)) / bw * 1e6


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--exllamav3", action="store_true", help="include ExLlamaV3 1.6.5 (must be importable)")
    ap.add_argument("--quick", action="store_true", help="headline shapes only")
    ap.add_argument("--iters", type=int, default=40)
    ap.add_argument("--rows", help="comma-separated row counts instead of the default list, e.g. 1,8")
    ap.add_argument("--shape", metavar="K,N,BITS,CB", action="append", default=[],
                    help="shapes instead of the default list (repeatable), e.g. 2048,768,4,mul1")
    ap.add_argument("--out", type=Path)
    ap.add_argument("--variants", action="store_true", help="skinny variants (split, grid, PDL), and --crossover")
    ap.add_argument("--crossover", action="store_true",
                    help="time skinny / panel / reconstruct (both bases) at 8..4096 rows on six layer sizes")
    ap.add_argument("--profile", action="store_true", help="per-kernel GPU times of one call (torch.profiler)")
    ap.add_argument("--trace", metavar="K,N,BITS,CB,ROWS", action="append", default=[],
                    help="per-warp timeline of one skinny launch (repeatable), e.g. 4096,14336,4,mul1,1")
    ap.add_argument("--ncu-target", metavar="K,N,BITS,CB,ROWS",
                    help="only run a few calls of one case (for Nsight Compute), e.g. 4096,14336,4,mul1,1")
    ap.add_argument("--group", metavar="K,N1/N2/..,BITS,CB",
                    help="only time native_linear_group against one native_linear per shard (q/k/v), e.g. "
                         "2048,4096/512/512,4,mcg (rows: --rows, default 1,4,8,16)")
    args = ap.parse_args()
    if err := native.unavailable_reason():
        raise SystemExit(f"native kernels unavailable: {err}")
    if args.group:
        bench_group(args.group, [int(r) for r in (args.rows or "1,4,8,16").split(",")], args.iters)
        return 0
    if args.ncu_target:
        k, n, bits, cb, rows = args.ncu_target.split(",")
        case = Case(int(k), int(n), float(bits), cb)
        x = torch.randn(int(rows), int(k), device=DEV, dtype=torch.float16)
        for w in case.ws[:4]:
            native.linear(x, w, 0, 0, int(n))
        torch.cuda.synchronize()
        return 0

    props = torch.cuda.get_device_properties(0)
    result = {"gpu": props.name, "sms": props.multi_processor_count, "torch": torch.__version__,
              "native_build": native.build_info(), "time": time.strftime("%Y-%m-%d %H:%M:%S"), "rows": {},
              "method": "CUDA events per call, queue pre-filled behind a sleep kernel, median of "
                        f"{args.iters}; weights rotated over >= {L2_DEFEAT_BYTES >> 20} MB of copies"}
    bw = copy_bandwidth()
    result["copy_bandwidth_TBps"] = bw / 1e12
    print(f"{props.name}: device copy {bw / 1e12:.2f} TB/s (read + write)", flush=True)

    shapes = [(4096, 14336, 4, "mul1"), (4096, 14336, 2, "mul1"), (4096, 14336, 3, "mul1"), (4096, 14336, 4, "mcg"),
              (4096, 14336, 2, "mcg"), (14336, 4096, 2, "mul1"), (14336, 4096, 4, "mul1"), (2048, 6144, 4, "mul1"),
              (2048, 6144, 4, "3inst"), (2048, 768, 4, "mul1")]
    rows_list = [1, 8, 32, 64, 128, 512, 4096]
    if args.quick:
        shapes = shapes[:2] + [shapes[3], shapes[6]]
        rows_list = [1, 8, 64, 512]
    if args.rows:
        rows_list = [int(r) for r in args.rows.split(",")]
    if args.shape:
        shapes = [(int(k), int(n), float(b), cb) for k, n, b, cb in (v.split(",") for v in args.shape)]

    exl_ok = False
    if args.exllamav3:
        from vllm_exl3.kernels.backends.exllamav3 import _import_error, make_layer
        exl_ok = _import_error() is None
        result["exllamav3"] = "ok" if exl_ok else _import_error()

    # Every shape's case is built first and the row counts run outermost: light calls measured after the heavy
    # 512/4096-row GEMMs of earlier shapes came out slower than in a run of light calls alone (bench/NOTES.md,
    # "Method").
    cases = []
    for k, n, bits, cb in shapes:
        case = Case(k, n, bits, cb)
        cases.append((case, [make_layer(w) for w in case.ws] if exl_ok else None))
    table = []
    for rows in rows_list:
        for case, layers in cases:
            k, n, bits, cb = case.k, case.n, case.bits, case.codebook
            flops = 2 * rows * k * n
            entry = {"shape": [k, n], "bits": bits, "codebook": cb, "rows": rows}
            entry["ours_us"] = bench_native(case, rows, args.iters)
            if exl_ok:
                entry["exllamav3_us"] = bench_exllamav3(case, rows, args.iters, layers)
            if cb == "mul1" and bits == 4 or (k, n) == (2048, 768):
                entry["bf16_cublas_us"] = bench_bf16(k, n, rows, args.iters)
            entry["floor_bytes_us"] = floor_us(case, rows, bw)
            for key in ("ours_us", "exllamav3_us", "bf16_cublas_us"):
                if key in entry:
                    entry[key.replace("_us", "_tflops")] = flops / (entry[key] * 1e-6) / 1e12
            table.append(entry)
            print(json.dumps(entry), flush=True)
    del cases
    torch.cuda.empty_cache()
    order = {shape: i for i, shape in enumerate(shapes)}
    table.sort(key=lambda e: (order[(e["shape"][0], e["shape"][1], e["bits"], e["codebook"])], e["rows"]))
    result["table"] = table

    if args.variants:
        # Skinny choices for tuning: codeword (dup) vs rounded pairs, split-K vs direct, grid size, PDL.
        var = []
        for k, n, bits, cb in [(4096, 14336, 4, "mul1"), (4096, 14336, 2, "mul1"), (4096, 14336, 4, "mcg"),
                               (14336, 4096, 4, "mul1")]:
            case = Case(k, n, bits, cb)
            for rows in (1, 8, 16):
                for name, path, env in [("split", NativePath.SKINNY_SPLIT, None),
                                        ("direct", NativePath.SKINNY_DIRECT, None),
                                        ("plain", NativePath.SKINNY_PLAIN, None),
                                        ("split_grid_x2", NativePath.SKINNY_SPLIT,
                                         {"VLLM_EXL3_SKINNY_GRID": str(4 * props.multi_processor_count)}),
                                        ("split_grid_1sm", NativePath.SKINNY_SPLIT,
                                         {"VLLM_EXL3_SKINNY_GRID": str(props.multi_processor_count)}),
                                        ("no_pdl", NativePath.SKINNY_SPLIT, {"VLLM_EXL3_PDL": "0"})]:
                    t = bench_native(case, rows, args.iters, path, env)
                    var.append({"case": case.name, "rows": rows, "variant": name, "us": t})
                    print(json.dumps(var[-1]), flush=True)
            del case
            torch.cuda.empty_cache()
        result["variants"] = var

    if args.variants or args.crossover:
        # Where `auto` should switch kernels: each path at each row count, large to small layers.
        var = result.setdefault("variants", [])
        for k, n in ((4096, 14336), (14336, 4096), (4096, 4096), (2048, 6144), (2048, 4096), (2048, 768)):
            case = Case(k, n, 4, "mul1")
            for rows in (8, 16, 24, 32, 48, 64, 96, 128, 192, 256, 512, 1024, 2048, 4096):
                for name, path in [("skinny", NativePath.SKINNY), ("panel", NativePath.PANEL),
                                   ("recon", NativePath.RECONSTRUCT), ("orig", NativePath.RECON_ORIGINAL)]:
                    if (name, rows > 128) == ("skinny", True) or (name, rows > 512) == ("panel", True) or \
                            (name, rows < 128) == ("orig", True):
                        continue  # far from their crossovers
                    t = bench_native(case, rows, max(10, args.iters // 2), path)
                    var.append({"case": case.name, "rows": rows, "variant": name, "us": t})
                    print(json.dumps(var[-1]), flush=True)
            del case
            torch.cuda.empty_cache()

    if args.trace:
        result["trace"] = [trace_skinny(spec) for spec in args.trace]

    if args.profile:
        try:
            result["profile"] = profile_kernels(exl_ok)
        except Exception as e:  # the profiler is a diagnostic; never lose the table for it
            print(f"profile failed: {e!r}", flush=True)

    # the table, last (the device tool returns the end of the output)
    print(f"\n{props.name}, copy {bw / 1e12:.2f} TB/s; µs per call (TFLOP/s for >= 512 rows)")
    print(f"{'shape':>12} {'bits':>9} {'rows':>5} {'ours':>9} {'exl3':>9} {'bf16':>9} {'floor':>7}")
    for e in table:
        def fmt(key):
            if key not in e:
                return "-"
            return f"{e[key]:.1f}" if e["rows"] < 512 else f"{e[key]:.0f}/{e[key.replace('_us', '_tflops')]:.0f}"
        print(f"{e['shape'][0]}x{e['shape'][1]:>6} {e['bits']:g}b {e['codebook']:>5} {e['rows']:>5} "
              f"{fmt('ours_us'):>9} {fmt('exllamav3_us'):>9} {fmt('bf16_cublas_us'):>9} {e['floor_bytes_us']:7.1f}")
    if args.out:
        args.out.parent.mkdir(parents=True, exist_ok=True)
        args.out.write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
