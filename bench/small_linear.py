"""A MoE router's 16-bit gate at decode sizes: vllm_exl3's small_linear (csrc/small_linear.cu) against the cuBLAS
calls vLLM's gate makes without it: F.linear (16-bit out) and torch.mm with an fp32 out dtype (the fused
bf16 x bf16 -> fp32 tier of vLLM's GateLinear).

    PYTHONPATH=plugin python bench/small_linear.py [--out FILE.json]

Shapes: Qwen3-30B-A3B's router (2048 -> 128) and GLM-4.5-Air's (4096 -> 128), bf16, 1..16 rows. Timing: as
bench/moe.py, one weight copy per call (enough copies that the L2 cannot hold them), all captured into one CUDA graph,
replayed; µs per call = graph time / calls (median of replays). Writes JSON and prints a table.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "plugin"))
sys.path.insert(0, str(Path(__file__).resolve().parent))

from kernels import save_result  # noqa: E402  (bench/kernels.py)
from moe import graph_time  # noqa: E402  (bench/moe.py)
from vllm_exl3.kernels import ops  # noqa: E402, F401  (registers torch.ops.vllm_exl3.*)
from vllm_exl3.kernels.backend import get_backend  # noqa: E402

DEV = "cuda"
SHAPES = {"qwen3-30b-a3b router": (2048, 128), "glm-4.5-air router": (4096, 128)}
ROWS = (1, 2, 4, 8, 16)
L2_DEFEAT = 160 << 20  # weight bytes in play per replay (H200 L2: 60 MB)


def forms(x, w):
    out = {"small_linear fp32": lambda: torch.ops.vllm_exl3.small_linear(x, w, True),
           "small_linear bf16": lambda: torch.ops.vllm_exl3.small_linear(x, w, False),
           "F.linear bf16": lambda: F.linear(x, w)}
    try:
        torch.mm(x, w.t(), out_dtype=torch.float32)
        out["torch.mm fp32 out"] = lambda: torch.mm(x, w.t(), out_dtype=torch.float32)
    except (TypeError, RuntimeError):  # a torch without the out_dtype overload
        pass
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    reason = get_backend("native").unavailable_reason()  # loads the kernels' library, which registers the op
    if reason:
        sys.exit(f"small_linear bench: the native backend is not usable here: {reason}")
    rows_out = []
    for name, (k, n) in SHAPES.items():
        copies = max(2, L2_DEFEAT // (k * n * 2))
        weights = [(torch.randn(n, k, device=DEV) * k ** -0.5).to(torch.bfloat16) for _ in range(copies)]
        for rows in ROWS:
            x = torch.randn(rows, k, device=DEV).to(torch.bfloat16)
            row = {"layer": name, "in": k, "out": n, "rows": rows}
            for form in forms(x, weights[0]):
                calls = [forms(x, w)[form] for w in weights]
                row[form + " us"] = graph_time(calls)
            print(json.dumps(row), flush=True)
            rows_out.append(row)
    path = save_result({"gpu": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": rows_out}, args.out,
                       "small-linear")
    print(f"{'layer':24s} {'rows':>4s} " + " ".join(f"{k[:-3]:>18s}" for k in rows_out[0] if k.endswith(" us")))
    for r in rows_out:
        print(f"{r['layer']:24s} {r['rows']:4d} " + " ".join(f"{r[k]:18.2f}" for k in r if k.endswith(" us")))
    print(f"written {path}")


if __name__ == "__main__":
    main()
