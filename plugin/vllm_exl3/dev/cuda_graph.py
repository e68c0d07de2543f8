"""Capture one call into a CUDA graph the way the GPU tests and the benchmarks all need it (and the way vLLM does
before serving): one warm-up call on a side stream, so that lazy work (allocator growth, library handles, kernel
attributes) happens outside the capture, then the capture itself. Used by tests/kernels/gpu and bench/*.py."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, TypeVar

import torch

T = TypeVar("T")


def capture(fn: Callable[[], T], cuda: Any = torch.cuda) -> tuple[Any, T]:
    """(graph, out): `fn` run once eagerly on a side stream, then once under capture. `out` is what the captured
    call returned: its tensors live in the graph's pool and each `graph.replay()` rewrites them. Inputs `fn` reads
    must stay the same tensors (copy new values into them) for replays to see them. `cuda` is torch.cuda (a
    stand-in only in tests/kernels/test_cuda_graph_helper.py, which checks the order on a machine without a GPU)."""
    side = cuda.Stream()
    side.wait_stream(cuda.current_stream())
    with cuda.stream(side):
        fn()
    cuda.current_stream().wait_stream(side)
    graph = cuda.CUDAGraph()
    with cuda.graph(graph):
        out = fn()
    return graph, out
