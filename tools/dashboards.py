#!/usr/bin/env python3
"""Generate the appliance's Grafana dashboards (deploy/grafana/dashboards/*.json) from the panel lists below.

    tools/dashboards.py            # write the JSON files
    tools/dashboards.py --check    # exit 1 if a committed file differs from what this generates

Every panel's queries use only the metrics of vLLM, the EXL3 exporter (plugin/vllm_exl3/appliance/metrics/
collector.py), the node exporter and the recording rules (deploy/prometheus/rules/recording.yml). A panel that can
only have data on some hosts says so in `needs`: "gpu" (NVIDIA GPUs and nvidia-smi, or the parity gate, which has
nothing to check where the torch reference is the only backend), "psi" (a kernel with pressure stall
information, /proc/pressure) or "spec" (a server with speculative decoding on: vLLM exports its spec-decode
counters only then). tests/e2e/test_observability_e2e.py runs every other query against a real Prometheus scraping
a real server and requires data. Standard library only.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "deploy" / "grafana" / "dashboards"
DATASOURCE = {"type": "prometheus", "uid": "prometheus"}  # deploy/grafana/provisioning/datasources/prometheus.yml
WIDTH = 24  # Grafana's grid
BY_NODE = "{{role}} (rank {{rank}})"


@dataclass(frozen=True)
class Query:
    expr: str
    legend: str = ""


@dataclass(frozen=True)
class Panel:
    title: str
    queries: tuple[Query, ...]
    unit: str = "short"
    kind: str = "timeseries"  # timeseries | stat | table
    width: int = 8
    height: int = 8
    description: str = ""
    needs: str | None = None  # None | "gpu" | "psi" | "spec": where the data can exist (see the module docstring)


@dataclass(frozen=True)
class Row:
    title: str
    panels: tuple[Panel, ...]


@dataclass(frozen=True)
class Dashboard:
    uid: str
    title: str
    description: str
    rows: tuple[Row, ...]
    tags: tuple[str, ...] = field(default=("vllm-exl3",))

    @property
    def panels(self) -> list[Panel]:
        return [p for r in self.rows for p in r.panels]


def q(expr: str, legend: str = "") -> Query:
    return Query(expr, legend)


# --- overview: what a user of the API sees -------------------------------------------------------------------
OVERVIEW = Dashboard("vllm-exl3-overview", "vLLM EXL3: overview",
                     "Traffic, errors, latency, throughput, queue and KV cache of the vLLM server (head or single).", (
    Row("Traffic and errors", (
        Panel("Requests finished / s", (q("sum by (finished_reason) (rate(vllm:request_success_total[1m]))",
                                          "{{finished_reason}}"),), "reqps"),
        Panel("HTTP responses / s by status", (q('sum by (status) (rate(http_requests_total{job="vllm"}[1m]))',
                                                 "{{status}}"),), "reqps",
              description="4xx and 5xx are client and server errors (vLLM's HTTP instrumentation)."),
        Panel("Tokens / s", (q("sum(vllm_exl3:generation_tokens_per_second:rate1m)", "generated"),
                             q("sum(vllm_exl3:prompt_tokens_per_second:rate1m)", "prompt")), "short"),
    )),
    # Beside the tokens per second: how much of it the drafts bought (docs/speculative.md). Empty without
    # --speculative-config, and in a minute without drafts (the rules record no ratio of nothing).
    Row("Speculative decoding (with --speculative-config)", (
        Panel("Draft acceptance rate", (q("max(vllm_exl3:spec_decode_acceptance_ratio:rate1m)", "accepted / drafted"),),
              "percentunit", needs="spec",
              description="Share of the proposed draft tokens the target model kept."),
        Panel("Mean acceptance length", (q("max(vllm_exl3:spec_decode_acceptance_length_tokens:mean1m)",
                                           "tokens per verify step"),), "short", needs="spec",
              description="Tokens one verify step yields per request: the accepted drafts plus the target's own "
                          "token. 1 means the drafts bought nothing."),
        Panel("Acceptance by draft position",
              (q("max by (position) (vllm_exl3:spec_decode_position_acceptance_ratio:rate1m)",
                 "position {{position}}"),),
              "percentunit", needs="spec",
              description="Share of drafts whose token at this position was kept (0 is the first); a token is kept "
                          "only if every one before it was."),
    )),
    Row("Latency", (
        Panel("Time to first token", (q("max(vllm_exl3:time_to_first_token_seconds:p50_5m)", "p50"),
                                      q("max(vllm_exl3:time_to_first_token_seconds:p90_5m)", "p90"),
                                      q("max(vllm_exl3:time_to_first_token_seconds:p99_5m)", "p99")), "s"),
        Panel("Inter-token latency", (q("max(vllm_exl3:inter_token_latency_seconds:p50_5m)", "p50"),
                                      q("max(vllm_exl3:inter_token_latency_seconds:p90_5m)", "p90"),
                                      q("max(vllm_exl3:inter_token_latency_seconds:p99_5m)", "p99")), "s"),
        Panel("End-to-end request latency", (q("max(vllm_exl3:e2e_request_latency_seconds:p50_5m)", "p50"),
                                             q("max(vllm_exl3:e2e_request_latency_seconds:p99_5m)", "p99")), "s"),
        Panel("Decode step (mean)", (q("max(vllm_exl3:decode_step_seconds:mean1m)", "ms per step"),), "s",
              description="Mean inter-token latency: one decode step of the engine."),
    )),
    Row("Scheduler and KV cache", (
        Panel("Requests running / waiting", (q("sum(vllm:num_requests_running)", "running"),
                                             q("sum(vllm:num_requests_waiting)", "waiting")), "short"),
        Panel("KV cache usage", (q("max(vllm:kv_cache_usage_perc)", "used"),), "percentunit"),
        Panel("Preemptions (5 min)", (q("sum(increase(vllm:num_preemptions_total[5m]))", "preemptions"),), "short"),
        Panel("Prompt tokens from the prefix cache",
              (q("sum(rate(vllm:prefix_cache_hits_total[5m]))"
                 " / clamp_min(sum(rate(vllm:prefix_cache_queries_total[5m])), 1)", "hit ratio"),), "percentunit"),
    )),
))

# --- EXL3: what the plugin decided and loaded ----------------------------------------------------------------
EXL3 = Dashboard("vllm-exl3-exl3", "vLLM EXL3: kernels, load, pack, parity",
                 "Backend decisions per layer type and rank, fallbacks, the weight load, the pack, the parity gate.", (
    Row("Kernel backends", (
        Panel("Backend per layer type", (q("max by (rank, role, layer_type, backend) (vllm_exl3_backend_info)"),),
              kind="table", width=8),
        Panel("Layers per backend",
              (q("sum by (rank, layer_type, variant, device, backend) (vllm_exl3_backend_layers)"),),
              kind="table", width=8),
        Panel("Fallback layers", (q("sum by (rank) (vllm_exl3_fallback_layers)", "rank {{rank}}"),), kind="stat",
              width=8, description="Layers served by a later backend although an earlier available one was preferred."),
        Panel("Backends passed over, and why", (q("max by (rank, layer_type, variant, backend, reason) "
                                                  "(vllm_exl3_backend_skipped_info)"),), kind="table", width=16),
        Panel("Backend availability", (q("max by (rank, backend, reason) (vllm_exl3_backend_available)"),),
              kind="table", width=8),
        Panel("Native build", (q("max by (rank, archs, version) (vllm_exl3_native_build_info)"),), kind="table",
              width=8),
        Panel("Workers up", (q("vllm_exl3_worker_up", "rank {{rank}} ({{role}})"),), kind="stat", width=8),
    )),
    Row("Weight load", (
        Panel("Load time", (q("vllm_exl3_weight_load_seconds", "rank {{rank}}"),), "s", kind="stat", width=6),
        Panel("Read throughput", (q("vllm_exl3_weight_load_bytes_per_second", "rank {{rank}}"),), "Bps",
              kind="stat", width=6),
        Panel("Bytes read", (q("vllm_exl3_weight_load_bytes", "rank {{rank}}"),), "bytes", kind="stat", width=6),
        Panel("Reader threads", (q("vllm_exl3_weight_load_workers", "rank {{rank}}"),), kind="stat", width=6),
    )),
    Row("Memory plan (the launcher's, per node) and what was allocated", (
        Panel("Planned weights and KV cache", (q("vllm_exl3_memory_plan_weights_bytes", "weights " + BY_NODE),
                                               q("vllm_exl3_memory_plan_kv_bytes", "KV cache " + BY_NODE)), "bytes",
              kind="stat", width=6, needs="gpu"),
        Panel("Planned context and KV tokens", (q("vllm_exl3_memory_plan_max_model_len_tokens", "context " + BY_NODE),
                                                q("vllm_exl3_memory_plan_kv_tokens", "KV tokens " + BY_NODE)),
              kind="stat", width=6, needs="gpu"),
        Panel("GPU memory allocated once the layers were bound", (
            q("vllm_exl3_device_allocated_bytes", "allocated, rank {{rank}}"),
            q("vllm_exl3_memory_plan_weights_bytes", "planned weights " + BY_NODE)), "bytes", kind="stat", width=6,
            needs="gpu"),
        Panel("KV cache as vLLM allocated it", (q("max by (instance, num_gpu_blocks, block_size, cache_dtype) "
                                                  "(vllm:cache_config_info)"),), kind="table", width=6),
    )),
    Row("Pack", (
        Panel("Pack", (q("max by (pack, architecture, codebooks, bits) (vllm_exl3_pack_info)"),), kind="table",
              width=8),
        Panel("Bytes by group", (q("max by (group) (vllm_exl3_pack_bytes)", "{{group}}"),), "bytes", kind="stat",
              width=8),
        Panel("Tensors by bit width and codebook", (q("max by (bits, codebook) (vllm_exl3_pack_tensors)",
                                                      "{{bits}} bit {{codebook}}"),), kind="stat", width=8),
    )),
    Row("Parity gate", (
        Panel("Failed checks", (q("vllm_exl3_parity_failed_checks", "rank {{rank}}"),), kind="stat", width=8),
        Panel("Checks by result", (q("sum by (rank, backend, layer_type, result) (vllm_exl3_parity_checks)"),),
              kind="table", width=8, needs="gpu"),
        Panel("Worst relative error vs bound", (
            q("max by (rank, backend, layer_type, variant) (vllm_exl3_parity_worst_relative_error)",
              "{{backend}} {{layer_type}} {{variant}} (rank {{rank}})"),
            q("max by (rank, backend, layer_type, variant) (vllm_exl3_parity_bound)", "bound")), kind="table",
            width=8, needs="gpu"),
    )),
))

# --- Spark health: both nodes side by side -------------------------------------------------------------------
SPARK = Dashboard("vllm-exl3-spark", "vLLM EXL3: Spark health",
                  "Unified memory, pressure, swap, page cache, GPU clocks and temperature, the peer link: every "
                  "node (role, rank) as its own series.", (
    Row("Memory", (
        Panel("MemAvailable", (q("node_memory_MemAvailable_bytes", BY_NODE),
                               q("vllm_exl3_memory_watchdog_soft_floor_bytes", "watchdog soft floor " + BY_NODE),
                               q("vllm_exl3_memory_watchdog_hard_floor_bytes", "watchdog hard floor " + BY_NODE)),
              "bytes"),
        Panel("Memory pressure (PSI)", (q("rate(node_pressure_memory_waiting_seconds_total[1m])", "some " + BY_NODE),
                                        q("rate(node_pressure_memory_stalled_seconds_total[1m])", "full " + BY_NODE)),
              "percentunit", needs="psi"),
        Panel("Swap used and page cache", (q("node_memory_SwapTotal_bytes - node_memory_SwapFree_bytes",
                                             "swap " + BY_NODE),
                                           q("node_memory_Cached_bytes", "page cache " + BY_NODE)), "bytes"),
        Panel("Memory watchdog", (q("max by (instance, role, rank, state) (vllm_exl3_memory_watchdog_state) == 1",
                                    "{{state}} " + BY_NODE),), kind="stat"),
        Panel("Watchdog events", (q("vllm_exl3_memory_watchdog_soft_events_total", "soft " + BY_NODE),
                                  q("vllm_exl3_memory_watchdog_hard_stops_total", "hard stops " + BY_NODE)),
              kind="stat"),
    )),
    Row("GPU", (
        Panel("GPU temperature", (q("vllm_exl3_gpu_temperature_celsius", "GPU {{gpu}} " + BY_NODE),), "celsius",
              needs="gpu"),
        Panel("GPU SM clock", (q("vllm_exl3_gpu_sm_clock_hertz", "GPU {{gpu}} " + BY_NODE),), "hertz", needs="gpu"),
        Panel("GPU power", (q("vllm_exl3_gpu_power_watts", "GPU {{gpu}} " + BY_NODE),), "watt", needs="gpu"),
    )),
    Row("Nodes", (
        Panel("Peer seen", (q("vllm_exl3_peer_alive", "{{role}} sees {{peer}}"),), kind="stat"),
        Panel("Scrape targets up", (q("up", "{{job}} " + BY_NODE),), kind="stat", width=16),
    )),
))

DASHBOARDS = (OVERVIEW, EXL3, SPARK)


def _panel_json(p: Panel, pid: int, x: int, y: int) -> dict:
    targets = [{"refId": chr(ord("A") + i), "datasource": DATASOURCE, "expr": t.expr, "legendFormat": t.legend,
                "instant": p.kind == "table", "range": p.kind != "table",
                **({"format": "table"} if p.kind == "table" else {})} for i, t in enumerate(p.queries)]
    panel = {"id": pid, "type": p.kind, "title": p.title, "description": p.description, "datasource": DATASOURCE,
             "gridPos": {"h": p.height, "w": p.width, "x": x, "y": y}, "targets": targets,
             "fieldConfig": {"defaults": {"unit": p.unit}, "overrides": []}, "options": {}}
    if p.kind == "table":
        panel["transformations"] = [{"id": "merge", "options": {}},
                                    {"id": "organize", "options": {"excludeByName": {"Time": True}}}]
    if p.kind == "stat":
        panel["options"] = {"reduceOptions": {"calcs": ["lastNotNull"], "fields": "", "values": False},
                            "colorMode": "value", "graphMode": "none", "textMode": "value_and_name"}
    return panel


def render(d: Dashboard) -> dict:
    panels, pid, y = [], 1, 0
    for row in d.rows:
        panels.append({"id": pid, "type": "row", "title": row.title, "collapsed": False, "panels": [],
                       "gridPos": {"h": 1, "w": WIDTH, "x": 0, "y": y}})
        pid, y, x, row_h = pid + 1, y + 1, 0, 0
        for p in row.panels:
            if x + p.width > WIDTH:
                x, y, row_h = 0, y + row_h, 0
            panels.append(_panel_json(p, pid, x, y))
            pid, x, row_h = pid + 1, x + p.width, max(row_h, p.height)
        y += row_h
    return {"uid": d.uid, "title": d.title, "description": d.description, "tags": list(d.tags),
            "editable": False, "schemaVersion": 39, "version": 1, "refresh": "10s", "timezone": "browser",
            "time": {"from": "now-1h", "to": "now"}, "templating": {"list": []}, "annotations": {"list": []},
            "panels": panels}


def files() -> dict[Path, str]:
    return {OUT / f"{d.uid}.json": json.dumps(render(d), indent=2, ensure_ascii=False) + "\n" for d in DASHBOARDS}


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--check", action="store_true", help="compare with the committed files instead of writing")
    a = p.parse_args(argv)
    stale = []
    for path, text in files().items():
        if a.check:
            if not path.is_file() or path.read_text() != text:
                stale.append(path.relative_to(ROOT))
        else:
            path.write_text(text)
    if stale:
        print(f"stale: {', '.join(map(str, stale))}: run tools/dashboards.py", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
