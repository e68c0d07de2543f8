"""`vllm-exl3 load-bench`: the parallel loader's cold-cache read rate on this disk (the measurement is
loader/load_bench.py's), as a table or JSON."""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from rich.table import Table

from ..base.argtypes import positive_int
from ..format.units import format_bytes
from .common import UsageError, console, err_console, worker_counts


def load_bench(p: argparse.ArgumentParser):
    """Cold-cache read GB/s of a pack on this disk: raw sequential reads, then `--load-format exl3_parallel`'s
    reader at each worker count (each tensor copied to the GPU when there is one, as vLLM does), in back-to-back
    pairs repeated round the worker counts, so a drifting disk moves both sides of each ratio."""
    p.add_argument("pack", help="model directory (or one .safetensors file)")
    p.add_argument("--workers", type=worker_counts, default=[1, 8], help="comma-separated worker counts (default 1,8)")
    p.add_argument("--chunk-mib", type=positive_int, help="read size per request")
    p.add_argument("--ring-mib", type=positive_int, help="read-ahead bound")
    p.add_argument("--direct-io", action=argparse.BooleanOptionalAction, default=None,
                   help="O_DIRECT reads (default on, or VLLM_EXL3_LOAD_DIRECT_IO)")
    p.add_argument("--limit-gb", type=float, help="measure only the first files holding this many GB")
    p.add_argument("--device", help="where tensors land (default: cuda if available, else cpu)")
    p.add_argument("--safetensors", action="store_true", help="also measure the safetensors (mmap) default")
    p.add_argument("--repeats", type=positive_int, default=3, help="pairs (raw reads, reader) per worker count; medians")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    def run(a: argparse.Namespace) -> int:
        import torch

        from ..loader import load_bench as loadbench
        from ..format.units import GB
        from ..loader.options import ReaderOptions

        config = {k: v for k, v in (("chunk_mib", a.chunk_mib), ("ring_mib", a.ring_mib),
                                    ("direct_io", a.direct_io)) if v is not None}
        base = ReaderOptions.from_config(config)
        workers = a.workers
        try:
            device = torch.device(a.device) if a.device else loadbench.default_device()
        except RuntimeError as e:
            raise UsageError(f"--device {a.device}: {e}", 2) from e
        if device.type == "cuda" and not torch.cuda.is_available():
            raise UsageError(f"--device {a.device}: this machine has no usable CUDA device (torch {torch.__version__}"
                             f", CUDA {torch.version.cuda or 'none'}); leave --device out to measure reads to cpu", 2)
        if not Path(a.pack).exists():
            raise UsageError(f"{a.pack}: no such model directory or .safetensors file")
        files = loadbench.limit_files(loadbench.pack_files(a.pack), int(a.limit_gb * GB) if a.limit_gb else None)
        if not a.json:
            err_console.print(f"measuring {format_bytes(sum(f.size for f in files))} in {len(files)} file(s) ...")
        result = loadbench.load_bench(files, workers, base, device, with_safetensors=a.safetensors,
                                      repeats=a.repeats)
        if a.json:
            print(json.dumps(result, indent=2))
            return 0
        console.print(f"{a.pack}: {format_bytes(result['bytes'])} of tensors, cold cache, chunk "
                      f"{result['chunk_mib']} MiB, {'O_DIRECT' if base.direct_io else 'buffered'}, to {device}; "
                      f"medians of {a.repeats}")
        t = Table()
        t.add_column("read")
        t.add_column("GB/s", justify="right")
        t.add_column("vs raw (median of pairs)", justify="right")
        reference = {"raw_sequential": "raw sequential (dd bs=16M)",
                     "raw_sequential_fadvise": "raw sequential, fadvise(SEQUENTIAL)",
                     "raw_direct_1": "raw O_DIRECT, 1 thread"}
        for method, label in reference.items():
            t.add_row(label + (" = raw" if method == result["raw_method"] else ""), f"{result[method + '_gbps']:.2f}")
        if "safetensors_gbps" in result:
            t.add_row("safetensors (vLLM default)", f"{result['safetensors_gbps']:.2f}")
        for w, gbps in result["loader_gbps"].items():
            t.add_row(f"exl3_parallel, {w} worker{'s' if w != '1' else ''}", f"{gbps:.2f}",
                      f"{result['loader_vs_raw'][w]:.0%}")
        console.print(t)
        return 0

    return run
