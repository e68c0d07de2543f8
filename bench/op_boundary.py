"""Host cost of one eager `vllm_exl3::moe` / `vllm_exl3::linear` call: the op boundary alone, the backend's work
replaced by an empty output (eager calls are vLLM's prefill steps and every step with --enforce-eager; CUDA graphs
replay none of this). The "before" rows of bench/results/cpu-op-boundary.json (fc9a136, where each call carried the
layer's whole argument list and rebuilt its expert stack) came from this script as of commit 874dc50, run against
that checkout; it now measures this tree only:

    PYTHONPATH=plugin python bench/op_boundary.py LABEL [--out FILE.json]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from pathlib import Path

import torch

from vllm_exl3.dev.synthetic import expert_stack, random_weights
from vllm_exl3.kernels import backend as kbackend
from vllm_exl3.kernels import interface, ops

HIDDEN, INTER, EXPERTS = 256, 384, 8


def calls(stack, w, x, tw, ti):
    """Bindings made once and served, then called through the ops."""

    class Moe(interface.BoundMoE):
        def __call__(self, x, *rest):
            return torch.empty_like(x)

    class Linear(interface.BoundLinear):
        def __call__(self, x):
            return x.new_empty((x.shape[0], INTER))

    held = [Moe(stack, interface.MoECall("silu", top_k=2)), Linear(w, 0, 0, INTER)]  # the ops hold them weakly
    for bound in held:
        ops.serve(bound)
    return (lambda: torch.ops.vllm_exl3.moe(x, tw, ti, None, stack.w13_trellis),
            lambda: torch.ops.vllm_exl3.linear(x, w.trellis, INTER), held)


def us_per_call(fn, n: int = 20000) -> float:
    for _ in range(200):
        fn()
    runs = []
    for _ in range(5):
        t = time.perf_counter()
        for _ in range(n):
            fn()
        runs.append((time.perf_counter() - t) / n * 1e6)
    return statistics.median(runs)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("label")
    ap.add_argument("--out")
    args = ap.parse_args()
    kbackend.load_backends()
    weights = [[random_weights(HIDDEN, INTER, 3, "mcg", seed=3 * e + p) for p in range(2)]
               + [random_weights(INTER, HIDDEN, 3, "mcg", seed=3 * e + 2)] for e in range(EXPERTS)]
    stack = expert_stack(weights, list(range(EXPERTS)))
    x, tw, ti = torch.randn(1, HIDDEN), torch.rand(1, 2), torch.tensor([[0, 1]], dtype=torch.int32)
    moe, linear, _held = calls(stack, weights[0][0], x, tw, ti)
    row = {"tree": args.label, "api": "bound", "torch": torch.__version__,
           "moe_us": round(us_per_call(moe), 2), "linear_us": round(us_per_call(linear), 2)}
    print(json.dumps(row))
    if args.out:
        out = Path(args.out)
        rows = json.loads(out.read_text())["rows"] if out.exists() else []
        out.write_text(json.dumps({"machine": "2-core CPU VM (CI's size)", "rows": rows + [row]}, indent=1))


if __name__ == "__main__":
    main()
