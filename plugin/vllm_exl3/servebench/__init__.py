"""`vllm-exl3 bench`: the serving benchmark, a client of any OpenAI-compatible endpoint (one, or two head to head).

Imports neither torch nor vLLM (it runs on a laptop against a server elsewhere): workload (the prompt categories,
data files), client (streaming HTTP), server_metrics (the server's /metrics), stats, runner, report, plots, saved
(a run's results.json read back)."""
