"""The appliance's commands: `launch`, `preflight` (appliance/launch.py) and `metrics` (appliance/metrics/)."""

from __future__ import annotations

import argparse


def launch(p: argparse.ArgumentParser):
    """Check the pack, network and memory, then run `vllm serve` for a role (single, head, worker) and preset."""
    from ..appliance import launch

    launch.add_arguments(p)
    return launch.run


def preflight(p: argparse.ArgumentParser):
    """The checks `launch` runs before starting vLLM (pack, kernel backend, network, head, memory plan), and the
    command it would run; starts nothing. Exit 0 when launch would start, 78 when it would refuse."""
    from ..appliance import launch

    launch.add_arguments(p, preflight_only=True)
    return launch.run


def metrics(p: argparse.ArgumentParser):
    """Serve the EXL3 and Spark-health metrics for Prometheus (docs/observability.md); runs until stopped."""
    from ..appliance.metrics.exporter import add_arguments

    add_arguments(p)

    def run(a: argparse.Namespace) -> int:
        import logging

        from ..appliance.metrics.exporter import serve

        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
        return serve(a)

    return run
