"""The parallel safetensors reader: plan, options, buffers, progress, reader, bench. Never imports vLLM."""
