"""The only package that imports vLLM: compat, register, the quantization config, linear, MoE, LM head, model loader."""
