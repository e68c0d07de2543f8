"""The bottom layer: the plumbing every other layer reads through. `settings` (every VLLM_EXL3_* variable, its
default and its readers), `state` (the state files' names, paths and readers), `http` (the one HTTP client),
`version`. Standard library only: it imports nothing above it, nor torch or vLLM."""
