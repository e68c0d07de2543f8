"""One dispatch interface for EXL3 compute; backends: `native` (our csrc), `exllamav3` (ExLlamaV3's kernels),
`torch` (the reference, always available).

Python decides *which* backend runs a layer (once, at load time, from `VLLM_EXL3_KERNEL`); the backend decides
*how* (e.g. GEMV vs GEMM by row count) inside the custom op, at run time, because branches on the token count
in traced Python code are frozen at trace time.

Modules: `requested` (what VLLM_EXL3_KERNEL and _STRICT ask for, read here; torch-free), `errors` (a kernel
setting that cannot be honoured; torch-free), `specs` (what a layer asks of a backend), `interface` (the Backend
interface, the layer bindings it makes once at load, and the table backends register in), `backend` (every backend
loaded, one by name), `selection` (which backend serves which layer, and why), `parity` (the boot-time gate: it
decides, integration/ acts), `ops` (the torch custom ops and the bindings they serve), `backends/` (native,
exllamav3, torch_ref). The CUDA extension is built
as `vllm_exl3.kernels._C`. This package never imports vLLM, and importing it alone imports nothing else.
"""
