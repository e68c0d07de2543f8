"""What the boot-time parity gate (plugin/vllm_exl3/kernels/parity.py) costs on a large model, on one GPU.

The gate checks the first layer of each (backend, layer type) and every layer of the last block. This times one
check of each layer a 100 B-class MoE model has (GLM-4.5-Air's shapes: hidden 4096, 96 query heads of 128, 8 KV
heads, 128 experts of width 1408, top-8, one shared expert; dense MLP 10944 in the first block), 4-bit mcg, bf16,
on the native backend against the torch reference, and adds them up as the gate would for that model: the first
layer of each type plus the last block (attention q, k, v, o; the routed experts; the shared expert's three).

    PYTHONPATH=plugin python bench/parity_cost.py --out bench/results/h200-parity-cost.json
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugin"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from moe import random_stack  # noqa: E402  (bench/moe.py)
from vllm_exl3.dev.synthetic import random_weights  # noqa: E402
from vllm_exl3.kernels import parity  # noqa: E402
from vllm_exl3.kernels.backend import get_backend  # noqa: E402
from vllm_exl3.kernels.interface import MoECall  # noqa: E402

DEV = "cuda"
HIDDEN, HEADS, KV_HEADS, HEAD_DIM = 4096, 96, 8, 128
EXPERTS, EXPERT_WIDTH, TOP_K, SHARED_WIDTH, DENSE_WIDTH = 128, 1408, 8, 1408, 10944
DENSE = {  # name: (in, out)
    "q_proj": (HIDDEN, HEADS * HEAD_DIM), "k_proj": (HIDDEN, KV_HEADS * HEAD_DIM),
    "v_proj": (HIDDEN, KV_HEADS * HEAD_DIM), "o_proj": (HEADS * HEAD_DIM, HIDDEN),
    "shared.gate_proj": (HIDDEN, SHARED_WIDTH), "shared.up_proj": (HIDDEN, SHARED_WIDTH),
    "shared.down_proj": (SHARED_WIDTH, HIDDEN),
    "dense.gate_proj": (HIDDEN, DENSE_WIDTH), "dense.down_proj": (DENSE_WIDTH, HIDDEN),
}
LAST_BLOCK = ("q_proj", "k_proj", "v_proj", "o_proj", "shared.gate_proj", "shared.up_proj", "shared.down_proj",
              "experts")


def timed(fn) -> tuple[float, float]:
    torch.cuda.synchronize()
    t0 = time.perf_counter()
    err, _ = fn()
    torch.cuda.synchronize()
    return time.perf_counter() - t0, err


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", required=True)
    ap.add_argument("--backend", default="native")
    args = ap.parse_args()
    backend = get_backend(args.backend)
    if (why := backend.unavailable_reason()) is not None:  # loads the backend's library (and registers its ops)
        sys.exit(f"{args.backend} backend unavailable: {why}")
    dtype = torch.bfloat16
    rows = {}
    for name, (k, n) in DENSE.items():
        w = random_weights(k, n, 4.0, "mcg", seed=len(rows), device=DEV)
        bound = backend.bind_linear(w, 0, 0, n)
        parity.linear_error(bound, k, dtype)  # warm-up: first launches, cuBLAS handles
        seconds, err = timed(lambda: parity.linear_error(bound, k, dtype))
        rows[name] = {"shape": [k, n], "seconds": seconds, "error": err}
        print(json.dumps({name: rows[name]}), flush=True)
    stack = random_stack(HIDDEN, EXPERT_WIDTH, EXPERTS, 4, "mcg", seed=0)
    experts = backend.bind_moe(stack, MoECall("silu", top_k=TOP_K, max_tokens=1024))
    parity.moe_error(experts, HIDDEN, dtype)
    seconds, err = timed(lambda: parity.moe_error(experts, HIDDEN, dtype))
    rows["experts"] = {"shape": [HIDDEN, EXPERT_WIDTH, EXPERTS], "seconds": seconds, "error": err}
    print(json.dumps({"experts": rows["experts"]}), flush=True)
    # One layer type (4-bit mcg) for every dense linear and one for the experts: the first layer of each, then the
    # last block. The first block's dense MLP is the first dense layer of its type only if nothing else came first;
    # the attention projections do, so it is not checked again.
    first = ["q_proj", "experts"]
    total = sum(rows[n]["seconds"] for n in first + list(LAST_BLOCK))
    result = {"gpu": torch.cuda.get_device_name(), "backend": args.backend, "dtype": str(dtype), "checks": rows,
              "gate_checks": first + list(LAST_BLOCK), "gate_seconds_glm45_air_shape": total}
    Path(args.out).write_text(json.dumps(result, indent=1))
    print(f"gate for a GLM-4.5-Air-shaped pack (4-bit mcg, bf16, {args.backend}): {len(first + list(LAST_BLOCK))} "
          f"checks, {total:.3f} s on {result['gpu']}")


if __name__ == "__main__":
    main()
