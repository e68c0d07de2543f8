"""The appliance: launcher, presets, preflight, network checks, memory plan, health, supervisor listener, settings.
Standard library (and psutil) only at import: never vLLM or torch, so health checks survive a broken server."""
