"""Routed-expert (MoE) layers on one GPU: a backend's op (native, or exllamav3 with --backend) vs the byte floor
(ExLlamaV3's BlockSparseMLP on a converted pack: bench/moe_exllamav3.py).

    PYTHONPATH=plugin python bench/moe.py [--quick] [--backend native|exllamav3] [--out FILE.json]

Layers: Qwen3-30B-A3B-shaped (hidden 2048, expert width 768, 128 experts, top-8) at 4 and 2 bits, GLM-4.5-Air-shaped
(4096, 1408, 128, top-8) at 4 bits; random trellis (mcg), random routing per layer copy. Timing: several layer copies
(so the L2 cannot hold the routed experts) called one after another inside one CUDA graph, replayed; µs per layer
call = graph time / copies (median of replays); eager times with the queue filled behind a sleep kernel. Floor:
the distinct routed experts' packed bytes at the measured device-to-device copy bandwidth. Writes JSON and prints a
table.
"""

from __future__ import annotations

import argparse
import json
import math
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugin"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels import copy_bandwidth, env_set, save_result, time_calls  # noqa: E402  (bench/kernels.py)
from vllm_exl3.dev.cuda_graph import capture  # noqa: E402
from vllm_exl3.format.constants import TILE  # noqa: E402
from vllm_exl3.kernels.backend import get_backend  # noqa: E402
from vllm_exl3.kernels.interface import MoECall  # noqa: E402
from vllm_exl3.kernels.specs import ExpertStack  # noqa: E402

DEV = "cuda"
TOKENS = (1, 2, 4, 8, 16, 32, 64, 256, 1024, 4096)
SHAPES = {"qwen3-30b-a3b": (2048, 768, 128, 8), "glm-4.5-air": (4096, 1408, 128, 8)}
L2_DEFEAT = 200 << 20  # routed bytes in play per graph replay (H200 L2: 60 MB)


def random_stack(hidden, inter, experts, bits, codebook, seed) -> ExpertStack:
    g = torch.Generator(device=DEV).manual_seed(seed)
    w = round(bits * TILE)

    def signs(*shape, scale=1.0):
        return ((torch.rand(*shape, device=DEV, generator=g) * 0.5 + 0.75) * scale
                * (torch.randint(0, 2, shape, device=DEV, generator=g) * 2 - 1)).half()

    t13 = torch.randint(-(2**15), 2**15, (experts, 2, hidden // TILE, inter // TILE, w), dtype=torch.int16,
                        device=DEV, generator=g)
    t2 = torch.randint(-(2**15), 2**15, (experts, inter // TILE, hidden // TILE, w), dtype=torch.int16, device=DEV,
                       generator=g)
    return ExpertStack(t13, signs(experts, 2, hidden, scale=hidden ** -0.5), signs(experts, 2, inter), t2,
                       signs(experts, inter, scale=inter ** -0.5), signs(experts, hidden), (w,) * (2 * experts),
                       (w,) * experts, (codebook,) * (3 * experts), 0, inter)


def routed_bytes(stack: ExpertStack, topk_ids: torch.Tensor) -> int:
    distinct = torch.unique(topk_ids).numel()
    per_expert = (stack.w13_trellis[0].numel() + stack.w2_trellis[0].numel()) * 2 + \
        (stack.w13_suh[0].numel() + stack.w13_svh[0].numel() + stack.w2_suh[0].numel() + stack.w2_svh[0].numel()) * 2
    return distinct * per_expert


def graph_time(calls, replays: int = 20) -> float:
    """µs per call: all `calls` captured into one graph, replayed."""
    graph, _ = capture(lambda: [c() for c in calls])
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(replays):
        s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        s.record()
        graph.replay()
        e.record()
        e.synchronize()
        times.append(s.elapsed_time(e) * 1000.0 / len(calls))
    del graph
    return statistics.median(times)


def bench_layer(name, hidden, inter, experts, top_k, bits, tokens_list, bandwidth, quick,
                backend="native", splits=((0, 0),)) -> list[dict]:
    native = get_backend(backend)
    layer_bytes = experts * 3 * hidden * inter * bits / 8
    copies = max(2, min(8, math.ceil(3 * L2_DEFEAT / layer_bytes) + 1))
    stacks = [random_stack(hidden, inter, experts, bits, "mcg", seed=s) for s in range(copies)]
    bound = [native.bind_moe(s, MoECall("silu", top_k=top_k, max_tokens=max(tokens_list))) for s in stacks]
    rows = []
    for tokens in tokens_list:
        g = torch.Generator().manual_seed(tokens)
        xs, routes = [], []
        for _ in stacks:
            logits = torch.randn(tokens, experts, generator=g)
            w, ids = torch.topk(logits.softmax(-1), top_k, dim=-1)
            routes.append(((w / w.sum(-1, keepdim=True)).to(DEV), ids.to(torch.int32).to(DEV)))
            xs.append(torch.randn(tokens, hidden, device=DEV, dtype=torch.float16))
        calls = [lambda i=i: bound[i](xs[i], routes[i][0], routes[i][1], None) for i in range(copies)]
        nbytes = statistics.mean(routed_bytes(stacks[i], routes[i][1]) for i in range(copies))
        flops = 2 * tokens * top_k * 3 * hidden * inter
        for s13, s2 in splits:  # (0, 0): the op's own split choice; others force them (VLLM_EXL3_MOE_SPLITS13/2)
            with env_set({"VLLM_EXL3_MOE_SPLITS13": str(s13), "VLLM_EXL3_MOE_SPLITS2": str(s2)}):
                us_graph = graph_time(calls, replays=10 if quick else 30)
                us_eager = time_calls(calls, iters=len(calls) * (3 if quick else 8))
            row = {"layer": name, "bits": bits, "tokens": tokens, f"{backend}_graph_us": us_graph,
                   f"{backend}_eager_us": us_eager,
                   "routed_bytes": nbytes, "gbps": nbytes / (us_graph * 1e-6) / 1e9,
                   "floor_us": nbytes / bandwidth * 1e6, "tflops": flops / (us_graph * 1e-6) / 1e12}
            if (s13, s2) != (0, 0):
                row |= {"splits13": s13, "splits2": s2}
            print(json.dumps(row), flush=True)
            rows.append(row)
    torch.cuda.empty_cache()
    return rows


def profile(tokens_list=(1, 8, 32, 64, 256, 1024)) -> None:
    """Device time of each kernel of one layer call (torch.profiler / CUPTI): where the time goes."""
    from torch.profiler import ProfilerActivity, profile as torch_profile

    native = get_backend("native")
    h, i, e, k = SHAPES["qwen3-30b-a3b"]
    stack = random_stack(h, i, e, 4, "mcg", seed=0)
    bound = native.bind_moe(stack, MoECall("silu", top_k=k, max_tokens=1024))
    for tokens in tokens_list:
        x = torch.randn(tokens, h, device=DEV, dtype=torch.float16)
        w, ids = torch.topk(torch.randn(tokens, e, device=DEV).softmax(-1), k, dim=-1)
        ids = ids.to(torch.int32)
        for _ in range(3):
            bound(x, w, ids, None)
        torch.cuda.synchronize()
        with torch_profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(10):
                bound(x, w, ids, None)
            torch.cuda.synchronize()
        for ev in prof.key_averages():
            if ev.device_type.name == "CUDA" and ev.count:
                print(json.dumps({"profile_tokens": tokens, "kernel": ev.key[:70], "us": ev.device_time_total / ev.count,
                                  "count": ev.count}), flush=True)


def ncu_target(tokens: int, calls: int = 6) -> None:
    """`calls` calls of one Qwen3-30B-A3B-shaped 4-bit layer at `tokens` tokens, for Nsight Compute to pick one
    kernel launch from (bench/moe_device.sh)."""
    h, i, e, k = SHAPES["qwen3-30b-a3b"]
    stack = random_stack(h, i, e, 4, "mcg", seed=0)
    bound = get_backend("native").bind_moe(stack, MoECall("silu", top_k=k, max_tokens=tokens))
    x = torch.randn(tokens, h, device=DEV, dtype=torch.float16)
    w, ids = torch.topk(torch.randn(tokens, e, device=DEV).softmax(-1), k, dim=-1)
    for _ in range(calls):
        bound(x, w, ids.to(torch.int32), None)
    torch.cuda.synchronize()


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--profile", action="store_true", help="per-kernel device times of one layer, then exit")
    ap.add_argument("--ncu-tokens", type=int, default=0, help="a few calls at this many tokens for ncu, then exit")
    ap.add_argument("--out", default=None)
    ap.add_argument("--backend", default="native", choices=("native", "exllamav3"))
    ap.add_argument("--layers", default="qwen3-30b-a3b:4,qwen3-30b-a3b:2,glm-4.5-air:4", help="name:bits,...")
    ap.add_argument("--tokens", default="", help="token counts, comma-separated (default: the sweep's, or --quick's)")
    ap.add_argument("--splits", default="", help="K splits to force, 'S13xS2,...' (0x0: the op's own choice), each "
                    "timed at every token count (native backend, up to 256 routed pairs)")
    args = ap.parse_args()
    torch.manual_seed(0)
    tokens = tuple(int(t) for t in args.tokens.split(",")) if args.tokens else None
    splits = tuple(tuple(int(v) for v in p.split("x")) for p in args.splits.split(",")) if args.splits else ((0, 0),)
    if args.profile:
        profile(*(tokens,) if tokens else ())
        return
    if args.ncu_tokens:
        ncu_target(args.ncu_tokens)
        return
    bw = copy_bandwidth()
    gpu = torch.cuda.get_device_name()
    print(f"{gpu}: device-to-device copy {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    if (why := get_backend(args.backend).unavailable_reason()) is not None:
        sys.exit(f"{args.backend} backend unavailable: {why}")
    for layer in args.layers.split(","):
        name, bits = layer.split(":")
        h, i, e, k = SHAPES[name]
        toks = tokens or (TOKENS if not args.quick else (1, 8, 64, 1024))
        rows += bench_layer(name, h, i, e, k, int(bits), toks, bw, args.quick, args.backend, splits)
    result = {"gpu": gpu, "copy_bandwidth": bw, "torch": torch.__version__, "backend": args.backend, "rows": rows}
    save_result(result, args.out, "moe")
    print(f"\n{'layer':16} {'bits':>4} {'tokens':>6} {'splits':>6} {'graph µs':>9} {'eager µs':>9} {'GB/s':>7} "
          f"{'floor µs':>8}")
    for r in rows:
        sp = f"{r['splits13']}x{r['splits2']}" if "splits13" in r else "op"
        print(f"{r['layer']:16} {r['bits']:>4} {r['tokens']:>6} {sp:>6} {r[args.backend + '_graph_us']:>9.1f} "
              f"{r[args.backend + '_eager_us']:>9.1f} {r['gbps']:>7.0f} {r['floor_us']:>8.1f}")


if __name__ == "__main__":
    main()
