"""Development helpers for tests, bench and the CLI (synthetic packs, parity); never imported by serving code."""
