"""One dispatch interface for EXL3 compute; backends: `native` (our csrc), `exllamav3` (ExLlamaV3's kernels),
`torch` (the reference, always available).

Python decides *which* backend runs a layer (once, at load time, from `VLLM_EXL3_KERNEL`); the backend decides
*how* (e.g. GEMV vs GEMM by row count) inside the custom op, at run time, because branches on the token count
in traced Python code are frozen at trace time.

Modules: `choice` (what VLLM_EXL3_KERNEL may name, parsed once; torch-free), `specs` (what a layer asks of a
backend), `backend` (the interface and registry), `selection` (which backend serves which layer, and why),
`ops` (the torch custom ops), `backends/` (native, exllamav3, torch_ref). The CUDA extension is built
as `vllm_exl3.kernels._C`. This package never imports vLLM, and importing it alone imports nothing else.
"""
