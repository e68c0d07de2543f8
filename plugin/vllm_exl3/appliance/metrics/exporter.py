"""`vllm-exl3 metrics`: serve the catalogue of collector.py over HTTP for Prometheus (one exporter per node).

Why a separate process rather than vLLM's `/metrics`: vLLM records its metrics in the API server process, our
layers run in the engine-core / worker processes, and the second Spark's worker runs headless, without an API
server. The workers publish their state as files (integration/telemetry.py); this process reads them at each
scrape, so it answers on both nodes, while vLLM boots, and after it dies (`vllm_exl3_worker_up` = 0).
"""

from __future__ import annotations

import argparse
import logging
import os
import signal
import threading
from pathlib import Path

from prometheus_client import CollectorRegistry, start_http_server

from ...base import settings
from ...base.argtypes import port_number
from ...base.state import state_dir
from .collector import Exl3Collector

logger = logging.getLogger(__name__)


def registry(state: str | os.PathLike, pack_dir: str, role: str) -> CollectorRegistry:
    reg = CollectorRegistry(auto_describe=False)
    reg.register(Exl3Collector(Path(state), pack_dir, role))
    return reg


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    p.add_argument("--host", default=settings.get("VLLM_EXL3_METRICS_HOST"),
                   help="bind address (VLLM_EXL3_METRICS_HOST)")
    p.add_argument("--port", type=port_number, default=settings.get("VLLM_EXL3_METRICS_PORT"),
                   help="port (VLLM_EXL3_METRICS_PORT)")
    p.add_argument("--state-dir", default=str(state_dir()), help="the state files' directory (VLLM_EXL3_STATE_DIR)")
    p.add_argument("--model", default=settings.get("VLLM_EXL3_MODEL"),
                   help="the pack, for the pack metrics (VLLM_EXL3_MODEL)")
    p.add_argument("--role", default=settings.get("VLLM_EXL3_ROLE") or "single",
                   help="single | head | worker (VLLM_EXL3_ROLE)")
    return p


def serve(args: argparse.Namespace, stop: threading.Event | None = None) -> int:
    stop = stop or threading.Event()
    try:
        server, thread = start_http_server(args.port, args.host, registry(args.state_dir, args.model, args.role))
    except OSError as e:
        logger.error("metrics: cannot listen on %s:%d (%s); set VLLM_EXL3_METRICS_HOST/PORT", args.host, args.port, e)
        return 2
    logger.info("metrics: exporter on http://%s:%d/metrics (state %s, pack %s, role %s)", args.host, args.port,
                args.state_dir, args.model, args.role)
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    stop.wait()
    server.shutdown()
    thread.join(5)
    return 0


def run(args: argparse.Namespace) -> int:
    """The exporter as a program (`vllm-exl3 metrics`, `python -m ...exporter`): its log on stderr, then `serve`."""
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
    return serve(args)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m vllm_exl3.appliance.metrics.exporter",
                                description=__doc__.splitlines()[0])
    return run(add_arguments(p).parse_args(argv))


if __name__ == "__main__":
    raise SystemExit(main())
