"""dev/cuda_graph.py's capture(), which the GPU tests and the benchmarks share, checked without a GPU: a stand-in
for torch.cuda records what happens in which order. The warm-up runs on a side stream that first waits for the
current one, the current stream waits for it before the capture starts, and only the second call is captured."""

from __future__ import annotations

import contextlib

from vllm_exl3.dev.cuda_graph import capture


class FakeCuda:
    def __init__(self):
        self.events: list[str] = []
        self.where = "main"
        self.capturing = False
        cuda = self

        class Stream:
            def __init__(self, name="side"):
                self.name = name
                cuda.events.append(f"new stream {name}")

            def wait_stream(self, other):
                cuda.events.append(f"{self.name} waits for {other.name}")

        class CUDAGraph:
            pass

        self.Stream, self.CUDAGraph = Stream, CUDAGraph
        self.main = Stream.__new__(Stream)
        self.main.name = "main"

    def current_stream(self):
        return self.main

    @contextlib.contextmanager
    def stream(self, s):
        self.where, before = s.name, self.where
        yield
        self.where = before

    @contextlib.contextmanager
    def graph(self, g):
        self.capturing = True
        self.events.append("capture begins")
        yield
        self.capturing = False
        self.events.append("capture ends")


def test_warm_up_on_a_side_stream_then_one_captured_call():
    cuda = FakeCuda()
    calls = []

    def fn():
        calls.append((cuda.where, cuda.capturing))
        cuda.events.append(f"call on {cuda.where}{' (captured)' if cuda.capturing else ''}")
        return len(calls)

    graph, out = capture(fn, cuda=cuda)
    assert isinstance(graph, cuda.CUDAGraph) and out == 2  # what the captured call returned
    assert calls == [("side", False), ("main", True)]
    assert cuda.events == ["new stream side", "side waits for main", "call on side", "main waits for side",
                           "capture begins", "call on main (captured)", "capture ends"]
