"""The kernel backends behind one interface: `native` (our CUDA kernels), `exllamav3`, `torch_ref` (the pure-torch
reference). Each module registers itself on import."""
