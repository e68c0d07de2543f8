"""Development helpers for tests, bench and the CLI: synthetic (EXL3 linears and packs), golden_logprobs (served
prompt logprobs vs golden logits), cuda_graph (one capture for the GPU tests and bench/); never imported by serving
code."""
