"""native_linear_group (csrc/bindings.cpp) on a GPU: 2..4 whole linears of one input (attention q, k, v) side by side,
one input-transform launch and one skinny GEMM launch for all shards up to 8 rows, one native_linear per shard
otherwise (16 rows below is that fallback: csrc/skinny.cuh says why).

Against the concatenated single-shard native_linear results on the same path, for every codebook x bit width of
test_native.py, q/k/v-like shapes (2048 -> 4096, 512, 512) and a small one (256 -> 128, 256, 384), rows 1/4/8/16,
fp16 and bf16, fresh random inputs, outputs poisoned before each call:
* no split-K ("direct"): each column group is summed by one block in the same warp order as the single-shard
  kernel, so the grouped result must be bit-identical;
* split-K ("split", and "auto"): the stream-K cut differs (it spans all shards' groups), so partial sums add up in
  another order: within test_native.py's bounds of the concatenation, and each shard within them of the fp32
  reference forward;
* two calls bit-identical (the split-K sums are in a fixed order), and CUDA-graph capture and replay;
* 17 and 40 rows (the per-shard fallback, as 16): bit-identical to the concatenation.
"""

from __future__ import annotations

import pytest
import torch

from vllm_exl3.format import reference as R
from vllm_exl3.format.constants import CODEBOOKS
from vllm_exl3.dev.cuda_graph import capture
from vllm_exl3.dev.synthetic import random_weights
from support.gpu import native_or_skip

pytestmark = pytest.mark.gpu

native = native_or_skip()

DEV = "cuda"
BOUND = {torch.float16: 2e-3, torch.bfloat16: 8e-3}  # test_native.py's, against the fp32 reference
WIDTHS = [(cb, float(b)) for cb in CODEBOOKS for b in range(1, 9)] + [("mul1", 1.5), ("mul1", 2.5), ("mul1", 3.5)]
WIDTH_IDS = [f"{c}-{b:g}b" for c, b in WIDTHS]
GROUPS = [(2048, (4096, 512, 512)), (256, (128, 256, 384))]  # (in, outs): all multiples of 128
ROWS = [1, 4, 8, 16]
P = native.NativePath
PATHS = {"auto": P.AUTO, "split": P.SKINNY_SPLIT, "direct": P.SKINNY_DIRECT}


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def poison(*shapes_dtypes) -> None:
    """Fill the caching allocator's next blocks with NaN, so an output element the kernel never writes shows up."""
    held = [torch.full(s, float("nan"), dtype=d, device=DEV) for s, d in shapes_dtypes]
    del held


def shards(k: int, outs, bits: float, codebook: str, seed: int):
    return [random_weights(k, n, bits, codebook, seed=seed + i, device=DEV) for i, n in enumerate(outs)]


def grouped(x, ws, path):
    n = sum(w.out_padded for w in ws)
    poison(((x.shape[0], n), x.dtype), ((1 << 22,), torch.float32))
    y = native.linear_group(x, ws, path)
    assert y.shape == (x.shape[0], n) and y.dtype == x.dtype
    assert torch.isfinite(y).all(), "unwritten or NaN output elements"
    return y


def concatenated(x, ws, path):
    return torch.cat([native.linear(x, w, 0, 0, w.out_padded, path) for w in ws], dim=1)


@pytest.mark.parametrize("codebook,bits", WIDTHS, ids=WIDTH_IDS)
def test_group_matches_single_shards(codebook, bits):
    failures = []
    for gi, (k, outs) in enumerate(GROUPS):
        ws = shards(k, outs, bits, codebook, seed=40 + 10 * gi)
        w_hats = [R.decode_rotated(w.trellis, codebook) for w in ws]
        cols = torch.tensor([0] + [w.out_padded for w in ws]).cumsum(0).tolist()
        for rows in ROWS:
            for dtype in (torch.float16, torch.bfloat16):
                x = torch.randn(rows, k, device=DEV).to(dtype)
                refs = [R.forward(x.float(), w, wh).float() for w, wh in zip(ws, w_hats)]
                for name, path in PATHS.items():
                    tag = f"{k}->{outs} rows={rows} {dtype} {name}"
                    y = grouped(x, ws, path)
                    single = concatenated(x, ws, path)
                    if name == "direct":
                        if not torch.equal(y, single):
                            failures.append(f"{tag}: not bit-identical to the single shards ({rel(y, single):.1e})")
                    # auto: the planner sees one linear of the total width, the single shards each their own,
                    # so the two may take different kernels, each within BOUND of the reference.
                    elif not rel(y, single) < BOUND[dtype] * (2 if name == "auto" else 1):
                        failures.append(f"{tag}: {rel(y, single):.2e} from the single shards")
                    for s, ref in enumerate(refs):
                        err = rel(y[:, cols[s]:cols[s + 1]], ref)
                        if not err < BOUND[dtype]:
                            failures.append(f"{tag} shard {s}: {err:.2e} from the reference")
                    again = native.linear_group(x, ws, path)
                    if not torch.equal(again, y):
                        failures.append(f"{tag}: moving result ({rel(again, y):.1e})")
    assert not failures, "\n".join(failures[:20])


@pytest.mark.parametrize("rows", [17, 40])
def test_more_rows_fall_back_to_single_shards(rows):
    ws = shards(256, (128, 256, 384), 4, "mcg", seed=7)
    x = torch.randn(rows, 256, device=DEV, dtype=torch.float16)
    assert torch.equal(grouped(x, ws, P.AUTO), concatenated(x, ws, P.AUTO))


@pytest.mark.parametrize("nshards", [2, 4])
def test_two_and_four_shards(nshards):
    ws = shards(512, (256, 128, 384, 128)[:nshards], 3, "mul1", seed=21)
    for rows in (1, 8, 16):
        x = torch.randn(rows, 512, device=DEV, dtype=torch.float16)
        assert torch.equal(grouped(x, ws, P.SKINNY_DIRECT), concatenated(x, ws, P.SKINNY_DIRECT))
        assert rel(grouped(x, ws, P.SKINNY_SPLIT), concatenated(x, ws, P.SKINNY_SPLIT)) < BOUND[torch.float16]


@pytest.mark.parametrize("rows,path", [(1, "split"), (4, "auto"), (8, "direct"), (16, "split")])
def test_cuda_graph_capture_and_replay(rows, path):
    ws = shards(2048, (4096, 512, 512), 4, "mcg", seed=13)
    x = torch.randn(rows, 2048, device=DEV, dtype=torch.float16)
    call = lambda: native.linear_group(x, ws, PATHS[path])  # noqa: E731
    graph, y_graph = capture(call)
    for _ in range(3):
        x.copy_(torch.randn_like(x))
        graph.replay()
        torch.cuda.synchronize()
        eager = call()
        assert torch.equal(y_graph, eager)
        assert rel(y_graph, concatenated(x, ws, PATHS[path])) < BOUND[torch.float16]


def test_rejects_mismatched_shards():
    a = random_weights(256, 128, 4, "mcg", seed=1, device=DEV)
    x = torch.randn(1, 256, device=DEV, dtype=torch.float16)
    with pytest.raises(RuntimeError):  # another bit width
        native.linear_group(x, [a, random_weights(256, 128, 3, "mcg", seed=2, device=DEV)])
    with pytest.raises(RuntimeError):  # another input width
        native.linear_group(x, [a, random_weights(384, 128, 4, "mcg", seed=3, device=DEV)])
    with pytest.raises(RuntimeError):  # one shard
        native.linear_group(x, [a])


def test_fake_impl_gives_shape():
    from torch._subclasses.fake_tensor import FakeTensorMode

    with FakeTensorMode():
        x = torch.empty(3, 256, dtype=torch.bfloat16, device=DEV)
        ts = [torch.empty(16, n // 16, 64, dtype=torch.int16, device=DEV) for n in (128, 384)]
        suh = [torch.empty(256, dtype=torch.float16, device=DEV)] * 2
        svh = [torch.empty(n, dtype=torch.float16, device=DEV) for n in (128, 384)]
        y = torch.ops.vllm_exl3.native_linear_group(x, ts, suh, svh, 1, 0)
        assert y.shape == (3, 512) and y.dtype == torch.bfloat16


@pytest.mark.parametrize("rows", [1, 8, 40])
def test_the_serving_op_runs_the_bound_group(rows):
    """What a grouped vLLM layer calls (integration/linear.py): torch.ops.vllm_exl3.linear_group on the native
    backend's BoundLinearGroup, found by the first shard's trellis: the native op's own result, bit for bit."""
    from vllm_exl3.kernels import ops
    from vllm_exl3.kernels.backend import get_backend

    ws = shards(2048, (4096, 512, 512), 4.0, "mcg", seed=40)
    backend = get_backend("native")
    group = backend.bind_linear_group([backend.bind_linear(w, 0, 0, w.out_padded) for w in ws])
    ops.serve(group)
    x = torch.randn(rows, 2048, device=DEV, dtype=torch.float16)
    y = torch.ops.vllm_exl3.linear_group(x, ws[0].trellis, group.out_features)
    assert torch.equal(y, native.linear_group(x, ws, P.AUTO))
    assert ops.serving(ws[0].trellis, "linear_group") is group and ops.serving(ws[0].trellis) is None
