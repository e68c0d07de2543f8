"""Development helpers for tests, bench and the CLI (synthetic packs, golden_logprobs: served logprobs vs golden logits,
cuda_graph: one capture for the GPU tests and bench/); never imported by serving code."""
