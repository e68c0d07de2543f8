"""Is a prefill tier worth building? The native MoE op at prefill sizes against what such a tier would do: every
local expert reconstructed once per call to bf16 in its original basis (W = diag(suh) H Ŵ H diag(svh), the native
`reconstruct` op, one launch per (expert, projection), captured in a CUDA graph: an upper bound for a batched
reconstruct kernel), then the routed rows through two grouped tensor-core GEMMs (torch._grouped_mm over the pairs
sorted by expert, no host sync).

    PYTHONPATH=plugin python bench/moe_prefill.py [--tokens 512,1024,...] [--out FILE.json]

Answered on the H200 (bench/notes/serving-run-04.md "Fourth run"): no; the tier takes 1.1-12x the op's time at 256-8192
tokens.

Random 4-bit mcg trellis and random routing, as bench/moe.py. Per row: the op's eager time, the tier's reconstruct
and GEMM times (CUDA events, medians), their ratio, and the tier's relative difference from the op's output (a
wrong tier is no answer). Writes JSON and prints a table; the crossover goes to a record under bench/notes/.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugin"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from vllm_exl3.dev.cuda_graph import capture  # noqa: E402
from vllm_exl3.kernels.backend import get_backend  # noqa: E402
from vllm_exl3.kernels.backends import native  # noqa: E402
from vllm_exl3.kernels.interface import MoECall  # noqa: E402
from vllm_exl3.kernels.specs import W2, W13  # noqa: E402

DEV = "cuda"
TOKENS = (256, 512, 1024, 2048, 4096, 8192)


def native_weight(w) -> torch.Tensor:
    """W in its original basis, bf16, (in, out) padded: the native `reconstruct` op."""
    return native.reconstruct(w, original_basis=True, bf16=True)


class Tier:
    """The candidate prefill tier for one layer: bf16 weights of every local expert, made per call by `weight`
    (native_weight on the GPU; any function giving W for an Exl3Weights, the reference's on the CPU test)."""

    def __init__(self, stack, top_k: int, weight=native_weight):
        e, h, i = stack.num_experts, stack.w13_suh.shape[-1], stack.w13_svh.shape[-1]
        device = stack.w13_trellis.device
        self.stack, self.top_k, self.inter, self.weight = stack, top_k, i, weight
        self.w13 = torch.empty(e, h, 2 * i, dtype=torch.bfloat16, device=device)  # gate | up, [K, N] per expert
        self.w2 = torch.empty(e, i, h, dtype=torch.bfloat16, device=device)

    def reconstruct(self) -> None:
        for e in range(self.stack.num_experts):
            for p, proj in enumerate(W13):
                self.w13[e, :, p * self.inter:(p + 1) * self.inter].copy_(self.weight(self.stack.weights(e, proj)))
            self.w2[e].copy_(self.weight(self.stack.weights(e, W2)))

    def gemms(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        experts = self.stack.num_experts
        flat = topk_ids.reshape(-1).long()
        order = flat.argsort(stable=True)
        token = order // self.top_k
        offs = torch.bincount(flat, minlength=experts).cumsum(0).to(torch.int32)
        gu = torch._grouped_mm(x[token], self.w13, offs=offs)
        act = F.silu(gu[:, :self.inter]) * gu[:, self.inter:]
        y = torch._grouped_mm(act, self.w2, offs=offs).float() * topk_weights.reshape(-1)[order, None].float()
        return torch.zeros(x.shape, dtype=torch.float32, device=x.device).index_add_(0, token, y).to(x.dtype)


def bench(name: str, tokens_list, iters: int) -> list[dict]:
    # bench/'s own modules, imported where the GPU run needs them: tests/bench/test_moe_prefill.py imports this file
    # for Tier inside pytest, where the name `kernels` is the tests' package
    from kernels import time_calls
    from moe import SHAPES, random_stack

    h, i, e, k = SHAPES[name]
    stack = random_stack(h, i, e, 4, "mcg", seed=0)
    op = get_backend("native").bind_moe(stack, MoECall("silu", top_k=k, max_tokens=max(tokens_list)))
    tier = Tier(stack, k)
    graph, _ = capture(tier.reconstruct)  # device time only: a batched kernel would launch once
    recon_us = statistics.median(_replay_us(graph) for _ in range(iters))
    rows = []
    for tokens in tokens_list:
        g = torch.Generator().manual_seed(tokens)
        w, ids = torch.topk(torch.randn(tokens, e, generator=g).softmax(-1), k, dim=-1)
        w, ids = (w / w.sum(-1, keepdim=True)).to(DEV), ids.to(torch.int32).to(DEV)
        x = torch.randn(tokens, h, generator=g).to(DEV, torch.bfloat16)
        y_op = op(x, w, ids, None)
        y_tier = tier.gemms(x, w, ids)
        diff = ((y_tier.float() - y_op.float()).norm() / y_op.float().norm()).item()
        op_us = time_calls([lambda: op(x, w, ids, None)], iters)
        gemm_us = time_calls([lambda: tier.gemms(x, w, ids)], iters)
        flops = 2 * tokens * k * 3 * h * i
        row = {"layer": name, "bits": 4, "tokens": tokens, "op_us": op_us, "tier_reconstruct_us": recon_us,
               "tier_gemm_us": gemm_us, "tier_us": recon_us + gemm_us, "tier_over_op": (recon_us + gemm_us) / op_us,
               "gemm_tflops": flops / (gemm_us * 1e-6) / 1e12, "rel_diff": diff}
        print(json.dumps(row), flush=True)
        rows.append(row)
    return rows


def _replay_us(graph) -> float:
    s, t = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record()
    graph.replay()
    t.record()
    t.synchronize()
    return s.elapsed_time(t) * 1000.0


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--tokens", default=",".join(map(str, TOKENS)))
    ap.add_argument("--layers", default="qwen3-30b-a3b,glm-4.5-air")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    if (why := native.unavailable_reason()) is not None:
        sys.exit(f"native backend unavailable: {why}")
    if not hasattr(torch, "_grouped_mm"):
        sys.exit(f"torch {torch.__version__} has no torch._grouped_mm")
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = [r for name in args.layers.split(",") for r in bench(name, tokens, args.iters)]
    from kernels import save_result  # bench/kernels.py (see bench())

    save_result({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows}, args.out,
                "moe-prefill")
    print(f"\n{'layer':14} {'tokens':>6} {'op µs':>8} {'recon µs':>9} {'gemm µs':>8} {'tier/op':>8} {'diff':>8}")
    for r in rows:
        print(f"{r['layer']:14} {r['tokens']:>6} {r['op_us']:>8.0f} {r['tier_reconstruct_us']:>9.0f} "
              f"{r['tier_gemm_us']:>8.0f} {r['tier_over_op']:>8.2f} {r['rel_diff']:>8.1e}")


if __name__ == "__main__":
    main()
