"""The appliance's metrics exporter: EXL3 and Spark-health metrics that vLLM's own `/metrics` cannot carry.

- the state files the serving processes publish (integration/telemetry.py: one per worker rank; the memory
  watchdog's, the heartbeat's and the launcher's files) are read and checked field by field by base/state.py.
- pack.py: the pack's own facts (format/summary.py), read header-only once.
- gpu.py: GPU clocks, temperature and power from `nvidia-smi`, where there is one.
- collector.py: every metric we export, named and documented in one catalogue, built at scrape time.
- exporter.py: the HTTP server (`vllm-exl3 metrics`; the appliance runs it under supervisord on every node).

Standard library and prometheus_client only: never torch or vLLM (it must keep answering while vLLM is down).
"""
