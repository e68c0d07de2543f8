"""Tensor and expert parallelism over two ranks, one process per GPU (NCCL), on a backend's dense and MoE ops.

    python bench/two_gpu.py --out bench/results/h200x2-parallel.json            # two GPUs, native backend
    python bench/two_gpu.py --device cpu --backend torch                        # the same checks on the CPU (gloo;
                                                                                # fixture layers only, no graphs/timing)

What each rank does, for the fixture packs' layers (tests/fixtures/exl3) and synthetic large layers:
- dense column-parallel (output split) and row-parallel (input split) slices by the plugin's TP rule
  (format/geometry.py `Span.around`: the 128-aligned block range around the rank's slice, as integration/linear.py
  loads it), including splits that start or end inside a 128-block; the op; all_gather (columns) or all_reduce
  (rows); compared with the unsplit layer's output on the same inputs (TP=1);
- routed experts split by intermediate range (`dev.synthetic.expert_stack`'s TP slice, inside a block too) and by
  experts (expert parallelism: `expert_map` with -1 for the other rank's experts); the op, then all_reduce;
  compared with the unsplit layer;
- on CUDA: the op + all_reduce captured in one CUDA graph and replayed on new inputs, equal to eager;
- on CUDA unless --no-timing: µs of the all_reduce of a [tokens, hidden] activation per MoE and dense layer at
  decode sizes, beside the op's own time, and what that predicts for two DGX Sparks over their link (the formula
  is printed and stored).
Rank 0 writes the JSON (--out) and prints a table; a mismatch beyond the bounds fails the run (exit 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
from pathlib import Path

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "plugin"))

from vllm_exl3.dev.cuda_graph import capture  # noqa: E402
from vllm_exl3.dev.synthetic import expert_stack, random_weights  # noqa: E402
from vllm_exl3.format.geometry import Span  # noqa: E402
from vllm_exl3.format.pack import Pack  # noqa: E402
from vllm_exl3.format.tensors import Exl3Weights, load_weights  # noqa: E402
from vllm_exl3.kernels.backend import get_backend  # noqa: E402
from vllm_exl3.kernels.interface import MoECall  # noqa: E402

FIXTURES = ROOT / "tests" / "fixtures" / "exl3"
WORLD = 2
BOUND = {torch.float16: 3e-3, torch.bfloat16: 1e-2, torch.float32: 1e-4}  # tests/support/moe_cases.py's bounds
DECODE_TOKENS = (1, 2, 4, 8, 16)
SPARK_LINK_BYTES_PER_S = 200e9 / 8  # one QSFP port of the ConnectX-7: 200 Gb/s
SPARK_ALLREDUCE_LATENCY_S = 10e-6  # an assumption for a 2-rank RoCE all_reduce of a few KB; stated with the result
PROJ = ("gate_proj", "up_proj", "down_proj")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def rank_slice(w: Exl3Weights, rows: Span, cols: Span) -> Exl3Weights:
    """What one rank stores of a linear: the trellis tiles, suh and svh of the block ranges around its slices."""
    return Exl3Weights(w.trellis[rows.tiles, cols.tiles].contiguous(), w.suh[rows.elements].contiguous(),
                       w.svh[cols.elements].contiguous(), w.codebook, w.bits)


def split_points(total: int) -> list[tuple[int, int]]:
    """Two ranks' ranges: an even split, and one that lands inside a 128-block when the width allows."""
    half = total // 2
    splits = [half]
    if total > 128 and (half + 40) % 128 and half + 40 < total:
        splits.append(half + 40)
    return [[(0, s), (s, total)] for s in splits]


def layers(device, large: bool) -> dict:
    """Dense linears and expert groups: the fixture packs' first block, and (`large`) synthetic large shapes."""
    dense, moe = {}, {}
    for pack_dir in sorted(p for p in FIXTURES.iterdir() if (p / "config.json").is_file()):
        pack = Pack.open(pack_dir)
        per_expert: dict[int, list] = {}
        for name, lin in pack.linears().items():
            if ".layers.0." not in name:
                continue
            w = load_weights(lin)
            w = Exl3Weights(w.trellis.to(device), w.suh.to(device), w.svh.to(device), w.codebook, w.bits)
            head, sep, tail = name.partition(".experts.")
            if sep:
                e, proj = tail.split(".")
                per_expert.setdefault(int(e), [None] * 3)[PROJ.index(proj)] = w
            elif name.endswith(("o_proj", "q_proj")):
                dense[f"{pack_dir.name}:{name}"] = w
        if per_expert:
            moe[f"{pack_dir.name}:layers.0.experts"] = [per_expert[e] for e in sorted(per_expert)]
    if not large:
        return {"dense": dense, "moe": moe}
    dense["synthetic:4096x14336:mul1-4b"] = random_weights(4096, 14336, 4.0, "mul1", seed=1, device=device)
    moe["synthetic:qwen3-30b-a3b-16experts:mcg-4b"] = [
        [random_weights(2048, 768, 4.0, "mcg", seed=10 * e + p, device=device) for p in range(2)]
        + [random_weights(768, 2048, 4.0, "mcg", seed=10 * e + 2, device=device)] for e in range(16)]
    return {"dense": dense, "moe": moe}


def routing(tokens: int, experts: int, top_k: int, seed: int, device):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(experts, generator=g)[:top_k] for _ in range(tokens)])
    return torch.rand(tokens, top_k, generator=g).softmax(-1).to(device), ids.to(torch.int32).to(device)


def time_us(fn, iters: int = 50) -> float:
    for _ in range(5):
        fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(iters):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        fn()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1000.0)
    return statistics.median(times)


def check_dense(backend, name, w, rank, dtype, device, results):
    k, n = w.in_padded, w.out_padded
    g = torch.Generator().manual_seed(7)
    x = torch.randn(9, k, generator=g).to(device, dtype)
    full = backend.bind_linear(w, 0, 0, n)(x)
    for parts in split_points(n):  # column parallel: each rank computes its outputs, all_gather
        o0, o1 = parts[rank]
        wr = rank_slice(w, Span.around(0, k, k), Span.around(o0, o1, n))
        cols = Span.around(o0, o1, n)
        y = backend.bind_linear(wr, 0, cols.offset, cols.size)(x)
        width = max(b - a for a, b in parts)  # all_gather takes equal sizes: pad, then trim each piece
        mine = torch.zeros(x.shape[0], width, dtype=dtype, device=device)
        mine[:, :y.shape[1]] = y
        pieces = [torch.empty_like(mine) for _ in parts]
        dist.all_gather(pieces, mine)
        gathered = torch.cat([p[:, :b - a] for p, (a, b) in zip(pieces, parts)], 1)
        results.append({"layer": name, "split": "columns", "ranges": parts, "rel_err": rel(gathered, full)})
    for parts in split_points(k):  # row parallel: each rank its inputs, all_reduce of partial sums
        i0, i1 = parts[rank]
        rows = Span.around(i0, i1, k)
        wr = rank_slice(w, rows, Span.around(0, n, n))
        y = backend.bind_linear(wr, rows.offset, 0, n)(x[:, i0:i1].contiguous()).float()
        dist.all_reduce(y)
        results.append({"layer": name, "split": "rows", "ranges": parts, "rel_err": rel(y, full)})


def check_moe(backend, name, weights, rank, dtype, device, results, graphs: bool):
    experts, top_k, tokens = len(weights), 2 if len(weights) <= 8 else 8, 24
    hidden, inter = weights[0][0].in_padded, weights[0][0].out_padded
    g = torch.Generator().manual_seed(11)
    x = torch.randn(tokens, hidden, generator=g).to(device, dtype)
    tw, ti = routing(tokens, experts, top_k, 11, device)
    whole = expert_stack(weights, list(range(experts)))
    call = MoECall("silu", top_k=top_k, max_tokens=tokens)
    full = backend.bind_moe(whole, call)(x, tw, ti, None)
    for parts in split_points(inter):  # tensor parallel: intermediate ranges
        i0, i1 = parts[rank]
        stack = expert_stack(weights, list(range(experts)), i0, i1)
        y = backend.bind_moe(stack, call)(x, tw, ti, None).float()
        dist.all_reduce(y)
        results.append({"layer": name, "split": "tp-intermediate", "ranges": parts, "rel_err": rel(y, full)})
    mine = list(range(rank, experts, WORLD))  # expert parallelism, round-robin placement
    emap = torch.full((experts,), -1, dtype=torch.int32, device=device)
    emap[mine] = torch.arange(len(mine), dtype=torch.int32, device=device)
    stack = expert_stack(weights, mine)
    bound = backend.bind_moe(stack, call)
    y = bound(x, tw, ti, emap).float()
    dist.all_reduce(y)
    results.append({"layer": name, "split": "expert-parallel", "ranges": [mine], "rel_err": rel(y, full)})
    if graphs:
        static = (x.clone(), tw.clone(), ti.clone())

        def step():
            out = bound(static[0], static[1], static[2], emap)
            dist.all_reduce(out)
            return out

        graph, captured = capture(step)
        tw2, ti2 = routing(tokens, experts, top_k, 99, device)
        static[0].copy_(torch.randn_like(x))
        static[1].copy_(tw2)
        static[2].copy_(ti2)
        graph.replay()
        eager = step()
        torch.cuda.synchronize()
        results.append({"layer": name, "split": "expert-parallel, CUDA graph (op + all_reduce) vs eager",
                        "ranges": [mine], "rel_err": rel(captured, eager), "bitwise_equal": bool(torch.equal(captured, eager))})


def timing(backend, rank, dtype, device) -> list[dict]:
    rows = []
    moe_w = [[random_weights(2048, 768, 4.0, "mcg", seed=10 * e + p, device=device) for p in range(2)]
             + [random_weights(768, 2048, 4.0, "mcg", seed=10 * e + 2, device=device)] for e in range(128)]
    stack = expert_stack(moe_w, list(range(rank * 64, rank * 64 + 64)))  # EP over 128 experts
    emap = torch.full((128,), -1, dtype=torch.int32, device=device)
    emap[rank * 64:rank * 64 + 64] = torch.arange(64, dtype=torch.int32, device=device)
    bound = backend.bind_moe(stack, MoECall("silu", top_k=8, max_tokens=16))
    for hidden in (2048, 4096):
        for tokens in DECODE_TOKENS:
            a = torch.randn(tokens, hidden, device=device, dtype=dtype)
            row = {"hidden": hidden, "tokens": tokens, "bytes": a.numel() * a.element_size(),
                   "all_reduce_us": time_us(lambda: dist.all_reduce(a))}
            if hidden == 2048:
                x = torch.randn(tokens, hidden, device=device, dtype=dtype)
                tw, ti = routing(tokens, 128, 8, tokens, device)
                row["moe_op_us(qwen3-30b-a3b, 64 local experts)"] = time_us(
                    lambda: bound(x, tw, ti, emap))
            link = row["bytes"] / SPARK_LINK_BYTES_PER_S  # two ranks: each sends and receives its buffer once
            row["spark_predicted_us"] = (SPARK_ALLREDUCE_LATENCY_S + link) * 1e6
            rows.append(row)
    return rows


def run(rank: int, args) -> None:
    os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
    os.environ.setdefault("MASTER_PORT", str(args.port))
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # never NVLink multicast (the device machines' rule)
    cuda = args.device == "cuda"
    dist.init_process_group("nccl" if cuda else "gloo", rank=rank, world_size=WORLD)
    device = torch.device(f"cuda:{rank}") if cuda else torch.device("cpu")
    if cuda:
        torch.cuda.set_device(device)
    backend = get_backend(args.backend)
    if (why := backend.unavailable_reason()) is not None:
        raise SystemExit(f"{args.backend} backend unavailable: {why}")
    dtype = torch.float16 if cuda else torch.float32
    torch.manual_seed(0)
    results: list[dict] = []
    found = layers(device, large=cuda)
    for name, w in found["dense"].items():
        check_dense(backend, name, w, rank, dtype, device, results)
    for name, weights in found["moe"].items():
        check_moe(backend, name, weights, rank, dtype, device, results, graphs=cuda)
    times = timing(backend, rank, dtype, device) if cuda and not args.no_timing else []
    dist.barrier()
    if rank == 0:
        bound = BOUND[dtype]
        failed = [r for r in results if r["rel_err"] > bound or r.get("bitwise_equal") is False]
        out = {"device": torch.cuda.get_device_name() if cuda else "cpu", "world": WORLD, "backend": args.backend,
               "dtype": str(dtype), "bound": bound, "checks": results, "timing": times,
               "spark_prediction": f"t = {SPARK_ALLREDUCE_LATENCY_S * 1e6:.0f} µs (assumed latency) + bytes / "
                                   f"{SPARK_LINK_BYTES_PER_S / 1e9:.0f} GB/s (200 Gb/s link), per all_reduce",
               "failed": len(failed)}
        if args.out:
            Path(args.out).write_text(json.dumps(out, indent=1))
        for r in results:
            print(f"{'FAIL' if r in failed else 'ok  '} {r['layer']:55} {r['split']:28} {r['rel_err']:.2e}")
        for t in times:
            print(json.dumps(t))
        print(f"{len(results) - len(failed)} passed, {len(failed)} failed")
        if failed:
            dist.destroy_process_group()
            sys.exit(1)
    dist.destroy_process_group()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--device", choices=("cuda", "cpu"), default="cuda")
    ap.add_argument("--backend", default="native")
    ap.add_argument("--out", default=None)
    ap.add_argument("--no-timing", action="store_true")
    ap.add_argument("--port", type=int, default=29533)
    args = ap.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < WORLD:
        sys.exit(f"needs {WORLD} GPUs, this machine has {torch.cuda.device_count()}")
    mp.spawn(run, args=(args,), nprocs=WORLD, join=True)


if __name__ == "__main__":
    main()
