"""One routed-experts layer of an ExLlamaV3-converted pack, side by side: ExLlamaV3 1.6.5's BlockSparseMLP.forward
(routing included) vs the native op on the same tensors (experts only, and with the router GEMM + softmax/top-k
in front, as vLLM runs it) vs the exllamav3 backend (ExLlamaV3's BlockSparseMLP rebuilt over our stack, vLLM's
routing handed in: its time over BlockSparseMLP.forward's is the backend's overhead), vs the byte floor.
bench/moe_exllamav3.sh makes the pack and runs this.

    PYTHONPATH=plugin:<exllamav3 site> python bench/moe_exllamav3.py --pack DIR --label qwen3-30b-a3b-4b --out F.json

Each call gets one of several fresh inputs (rotated), so successive calls route to different experts and the L2
cannot serve the weights. Times: medians, eager (queue filled behind a sleep kernel) and CUDA-graph replay where
the implementation captures (ExLlamaV3 does a host copy from 16 rows up). Also reports the relative difference of
the two outputs for the same routing (both read the same pack).
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugin"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels import copy_bandwidth, time_calls  # noqa: E402  (bench/kernels.py)
from moe import TOKENS, graph_time, routed_bytes  # noqa: E402  (bench/moe.py)
from vllm_exl3.dev.synthetic import expert_stack  # noqa: E402
from vllm_exl3.format.pack import Pack  # noqa: E402
from vllm_exl3.format.tensors import load_weights, read_tensor  # noqa: E402
from vllm_exl3.kernels.backend import get_backend  # noqa: E402
from vllm_exl3.kernels.interface import MoECall  # noqa: E402

DEV = "cuda"
PROJ = ("gate_proj", "up_proj", "down_proj")
INPUTS = 8


def find_module(root, cls_name):
    seen, todo = set(), [root]
    while todo:
        m = todo.pop()
        if id(m) in seen:
            continue
        seen.add(id(m))
        if type(m).__name__ == cls_name:
            return m
        todo.extend(getattr(m, "modules", []) or [])
    raise LookupError(f"no {cls_name} in the ExLlamaV3 model")


def our_layer(pack_dir: Path):
    pack = Pack.open(pack_dir)
    per_expert: dict[int, list] = {}
    prefix = None
    for name, lin in pack.linears().items():
        head, sep, tail = name.partition(".experts.")
        if not sep:
            continue
        prefix = head
        e, proj = tail.split(".")
        w = load_weights(lin)
        w = type(w)(w.trellis.to(DEV), w.suh.to(DEV), w.svh.to(DEV), w.codebook, w.bits)
        per_expert.setdefault(int(e), [None] * 3)[PROJ.index(proj)] = w
    weights = [per_expert[e] for e in sorted(per_expert)]
    gate = read_tensor(pack.tensors[f"{prefix}.gate.weight"]).to(DEV, torch.float16)  # router [E, H]
    return expert_stack(weights, list(range(len(weights)))), gate


def route(x, gate, top_k):
    w, ids = torch.topk(torch.softmax((x @ gate.t()).float(), dim=-1), top_k, dim=-1)
    return w / w.sum(-1, keepdim=True), ids.to(torch.int32)


def maybe_graph(calls, replays):
    try:
        return graph_time(calls, replays)
    except Exception as e:  # not capturable at this size
        torch.cuda.synchronize()
        return {"not capturable": str(e).splitlines()[0][:120]}


def main() -> None:
    from exllamav3 import Config, Model

    ap = argparse.ArgumentParser()
    ap.add_argument("--pack", required=True)
    ap.add_argument("--label", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    args = ap.parse_args()
    torch.manual_seed(0)
    bw = copy_bandwidth()
    model = Model.from_config(Config.from_directory(args.pack))
    model.load("cuda:0")
    exl = find_module(model, "BlockSparseMLP")
    stack, gate = our_layer(Path(args.pack))
    top_k = exl.num_experts_per_tok
    native = get_backend("native")
    call = MoECall("silu", top_k=top_k, max_tokens=1024)
    ours_bound = native.bind_moe(stack, call)
    exl_bound = get_backend("exllamav3").bind_moe(stack, call)
    hidden = stack.w13_suh.shape[-1]
    rows = []
    for tokens in map(int, args.tokens.split(",")):
        xs = [torch.randn(tokens, hidden, device=DEV, dtype=torch.float16) for _ in range(INPUTS)]
        routes = [route(x, gate, top_k) for x in xs]
        ours = [lambda i=i: ours_bound(xs[i], routes[i][0], routes[i][1], None) for i in range(INPUTS)]

        def with_router(i):
            w, ids = route(xs[i], gate, top_k)
            return ours_bound(xs[i], w, ids, None)

        ours_routed = [lambda i=i: with_router(i) for i in range(INPUTS)]
        theirs = [lambda i=i: exl.forward(xs[i], {}) for i in range(INPUTS)]
        backend = [lambda i=i: exl_bound(xs[i], routes[i][0], routes[i][1], None) for i in range(INPUTS)]
        y_exl = theirs[0]().float()
        y_ours = ours[0]().float()
        y_backend = backend[0]().float()
        diff = ((y_exl - y_ours).norm() / y_exl.norm()).item()
        diff_backend = ((y_exl - y_backend).norm() / y_exl.norm()).item()
        iters = INPUTS * (4 if tokens >= 1024 else 12)
        nbytes = statistics.mean(routed_bytes(stack, r[1]) for r in routes)
        exl_eager = time_calls(theirs, iters)
        backend_eager = time_calls(backend, iters)
        row = {"layer": args.label, "tokens": tokens,
               "exllamav3_eager_us": exl_eager, "exllamav3_graph_us": maybe_graph(theirs, 10) if tokens <= 8 else "host copy from 16 rows",
               "exl3_backend_eager_us": backend_eager, "exl3_backend_graph_us": maybe_graph(backend, 10),
               "exl3_backend_over_blocksparse": backend_eager / exl_eager,
               "rel_diff_exl3_backend_vs_exllamav3": diff_backend,
               "native_eager_us": time_calls(ours, iters), "native_graph_us": graph_time(ours, 10),
               "native_with_router_graph_us": graph_time(ours_routed, 10), "routed_bytes": nbytes,
               "floor_us": nbytes / bw * 1e6, "rel_diff_vs_exllamav3": diff}
        print(json.dumps(row), flush=True)
        rows.append(row)
    result = {"gpu": torch.cuda.get_device_name(), "copy_bandwidth": bw, "pack": args.label, "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1))

    def fmt(v):
        return f"{v:9.1f}" if isinstance(v, float) else f"{'n/c':>9}"

    print(f"\n{args.label}: tokens, ExLlamaV3 eager/graph, native eager/graph/+router, exllamav3 backend "
          "eager/graph and eager over ExLlamaV3's, floor µs, rel diff native / backend")
    for r in rows:
        print(f"{r['tokens']:>6} {fmt(r['exllamav3_eager_us'])} {fmt(r['exllamav3_graph_us'])} "
              f"{fmt(r['native_eager_us'])} {fmt(r['native_graph_us'])} {fmt(r['native_with_router_graph_us'])} "
              f"{fmt(r['exl3_backend_eager_us'])} {fmt(r['exl3_backend_graph_us'])} "
              f"{r['exl3_backend_over_blocksparse']:6.3f} {r['floor_us']:8.1f} {r['rel_diff_vs_exllamav3']:.1e} "
              f"{r['rel_diff_exl3_backend_vs_exllamav3']:.1e}")


if __name__ == "__main__":
    main()
