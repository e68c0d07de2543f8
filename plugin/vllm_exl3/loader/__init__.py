"""The parallel safetensors reader: plan, options, buffers, files, progress, reader, load_bench. Never imports vLLM."""
