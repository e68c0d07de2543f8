"""Development helpers for tests, bench and the CLI (synthetic packs, golden_logprobs: served logprobs vs golden logits); never imported by serving code."""
