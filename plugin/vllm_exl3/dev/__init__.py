"""Development helpers for tests, bench and the CLI: synthetic (EXL3 linears and packs), trellis (EXL3 linears that
decode to a chosen weight), family_oracle (packs checked against transformers), mtp (a GLM-4.5 pack with its MTP
layer, and what it drafts), golden_logprobs (served prompt logprobs vs golden logits), cuda_graph (one capture for
the GPU tests and bench/); never imported by serving code."""
