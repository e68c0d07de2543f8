"""bench/gpu/stepprofile.py: where a served step's time goes. The whole path (vLLM's torch profiler enabled by
`profiler_flags`, /start_profile and /stop_profile around a window, the traces vLLM writes, the per-step summary)
runs here against real vLLM (CPU build) serving the demo pack, with operators in place of the GPU's kernels."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest
from support.servers import vllm_server
from vllm_exl3 import demo

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("stepprofile", ROOT / "bench" / "gpu" / "stepprofile.py")
sp = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sp)


@pytest.mark.parametrize("name, cls", [
    # demangled names of the form CUPTI reports (our kernels: csrc/moe.cu, csrc/skinny.cuh, csrc/input_transform.cu)
    ("void exl3::(anonymous namespace)::moe_gemm_kernel<4, 8, true>(exl3::MoeGemmArgs)", "exl3 moe gemm"),
    ("void exl3::(anonymous namespace)::moe_gather_kernel<__half>(exl3::MoeTransformArgs)",
     "exl3 moe route/transforms/reduce"),
    ("void exl3::skinny_kernel<2, 4, 1>(exl3::GemmArgs)", "exl3 dense"),
    ("void exl3::input_transform_kernel<8>(exl3::InputTransformArgs)", "exl3 dense"),
    ("vllm_exl3::linear", "exl3 op (cpu)"),
    ("void marlin_moe_wna16::Marlin<...>", "marlin moe"),
    ("void flash::flash_fwd_splitkv_kernel<...>", "attention"),
    ("triton_poi_fused_add_mul_0", "compiled elementwise (triton)"),
    ("triton_red_fused_fused_add_rms_norm_machete_mm_1", "compiled elementwise (triton)"),  # not Machete's GEMM
    ("void humming<MmaOpClass, Shape<0u, 2048u, 768u>, ...>", "vllm gptq moe (humming)"),
    ("void at::native::(anonymous namespace)::distribution_elementwise_grid_stride_kernel<float, 4, ...>",
     "routing simulation (bench only)"),
    ("void at::native::bitonicSortKVInPlace<-2, -1, 16, 16, float, long, ...>", "moe routing (vllm)"),
    ("void at::native::vectorized_elementwise_kernel<4, ...>", "other"),
])
def test_kernel_classes(name, cls):
    assert sp.classify(name) == cls


def test_summary_is_per_step_and_keeps_only_the_category():
    skinny = "void exl3::skinny_kernel<2, 4, 1>(exl3::GemmArgs)"
    events = [{"ph": "X", "cat": "kernel", "name": skinny, "dur": 10.0, "ts": 0.0, "pid": 0, "tid": 7},
              {"ph": "X", "cat": "kernel", "name": skinny, "dur": 14.0, "ts": 20.0, "pid": 0, "tid": 7},
              {"ph": "X", "cat": "kernel", "name": "void flash::flash_fwd_kernel<>", "dur": 6.0, "ts": 40.0,
               "pid": 0, "tid": 7},
              {"ph": "X", "cat": "cpu_op", "name": "aten::mm", "dur": 1000.0, "ts": 0.0, "pid": 1, "tid": 1},
              {"ph": "i", "cat": "kernel", "name": "instant", "dur": 5.0, "ts": 50.0, "pid": 0, "tid": 7}]
    s = sp.summarize(events, steps=2, category="kernel")
    assert s["events"] == 3 and s["us_per_step"] == pytest.approx(15.0) == s["inclusive_us_per_step"]
    assert s["by_class_us_per_step"] == {"exl3 dense": pytest.approx(12.0), "attention": pytest.approx(3.0)}
    assert s["top"][0] == {"name": skinny, "class": "exl3 dense", "calls": 2, "us_per_step": pytest.approx(12.0),
                           "inclusive_us_per_step": pytest.approx(12.0)}


def test_kernels_overlapping_on_a_stream_count_once():
    """Programmatic dependent launch: the GEMM starts at 8 while the transform runs until 10 and waits inside; its
    exclusive time starts at 10, so that stream's kernels sum to the 30 µs it was busy (inclusive: 32). A kernel on
    another stream overlapping them keeps its own 4 µs."""
    ev = lambda name, ts, dur, tid=7: {"ph": "X", "cat": "kernel", "name": name, "ts": ts, "dur": dur,
                                       "pid": 0, "tid": tid}
    events = [ev("void exl3::moe_gemm_kernel<8, false, 8>(exl3::MoeGemmArgs)", 8.0, 12.0),
              ev("exl3::(anonymous namespace)::moe_route_kernel(exl3::MoeRouteArgs)", 0.0, 10.0),
              ev("void flash::flash_fwd_kernel<>", 20.0, 10.0),
              ev("void flash::flash_fwd_kernel<>", 5.0, 4.0, tid=9)]
    s = sp.summarize(events, steps=1, category="kernel")
    assert s["inclusive_us_per_step"] == pytest.approx(36.0) and s["us_per_step"] == pytest.approx(34.0)
    assert s["by_class_us_per_step"] == {
        "attention": pytest.approx(14.0), "exl3 moe gemm": pytest.approx(10.0),
        "exl3 moe route/transforms/reduce": pytest.approx(10.0)}


@pytest.mark.e2e
def test_profiled_windows_through_the_real_server(tmp_path):
    traces = tmp_path / "traces"
    with vllm_server(demo.PACK, tmp_path, *sp.profiler_flags(traces)) as server:
        rows = sp.profile(server.base_url, server.model, traces, [1, 2], 8, category="cpu_op")
    assert [r["concurrency"] for r in rows] == [1, 2]
    for r in rows:
        assert "error" not in r, r
        assert r["steps"] >= 8  # 8 tokens: at least one step each (prefill, then decode)
        assert r["traces"] and all(Path(p).is_file() for p in r["traces"])
        assert r["by_class_us_per_step"]["exl3 op (cpu)"] > 0
        names = {t["name"] for t in r["top"]}
        assert {"vllm_exl3::linear", "vllm_exl3::moe"} <= names, names
    # each window read only its own traces
    assert set(rows[0]["traces"]).isdisjoint(rows[1]["traces"])
