"""The boot-time parity gate's checks with the native backend on a GPU: every EXL3 linear and every routed-experts
layer of the fixture packs passes against the torch reference within the gate's bounds (kernels/parity.py), and
what one check costs (printed; the gate runs one check per layer type plus the last block's layers)."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from support.gpu import native_or_skip, on_cuda

pytestmark = pytest.mark.gpu
native = native_or_skip()

from vllm_exl3.dev.synthetic import expert_stack  # noqa: E402
from vllm_exl3.format.pack import Pack  # noqa: E402
from vllm_exl3.format.tensors import load_weights  # noqa: E402
from vllm_exl3.kernels import parity  # noqa: E402
from vllm_exl3.kernels.backend import get_backend  # noqa: E402
from vllm_exl3.kernels.interface import MoECall  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "exl3"
PACKS = sorted(p.name for p in FIXTURES.iterdir() if (p / "config.json").is_file())
PROJ = ("gate_proj", "up_proj", "down_proj")


@pytest.mark.parametrize("pack", PACKS)
def test_native_passes_the_gate_on_every_layer(pack):
    backend = get_backend("native")
    bound = parity.BOUNDS[torch.float16]
    linears = Pack.open(FIXTURES / pack).linears()
    experts: dict[str, dict[int, list]] = {}
    times, worst = [], 0.0
    for name, lin in linears.items():
        head, sep, tail = name.partition(".experts.")
        w = on_cuda(load_weights(lin))
        if sep:
            e, proj = tail.split(".")
            experts.setdefault(head, {}).setdefault(int(e), [None] * 3)[PROJ.index(proj)] = w
            continue
        t0 = time.perf_counter()
        err, _ = parity.linear_error(backend.bind_linear(w, 0, 0, w.out_padded), w.in_padded, torch.float16)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        worst = max(worst, err)
        assert err < bound, (name, err)
    for name, per_expert in experts.items():
        stack = expert_stack([per_expert[e] for e in sorted(per_expert)], list(range(len(per_expert))))
        t0 = time.perf_counter()
        err, _ = parity.moe_error(backend.bind_moe(stack, MoECall("silu", top_k=2, max_tokens=64)),
                                  stack.w13_suh.shape[-1], torch.float16)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
        worst = max(worst, err)
        assert err < bound, (name, err)
    print(f"{pack}: {len(times)} checks, worst error {worst:.1e}, median {sorted(times)[len(times) // 2] * 1e3:.1f} "
          f"ms, max {max(times) * 1e3:.1f} ms per check")
