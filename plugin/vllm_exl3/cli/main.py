"""`vllm-exl3` command line: parse arguments, call the modules that do the work, render the result."""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections.abc import Callable
from pathlib import Path

from rich.console import Console
from rich.table import Table

from ..format.errors import Exl3FormatError
from ..format.pack import Pack
from ..format.units import format_bytes

console = Console()
err_console = Console(stderr=True)

_COMMANDS: dict[str, Callable[[argparse.ArgumentParser], Callable[[argparse.Namespace], int]]] = {}


def command(name: str):
    """Register `fn(parser) -> handler` as the subcommand `name`."""

    def deco(fn):
        _COMMANDS[name] = fn
        return fn

    return deco


def _gib(n: int) -> str:
    return format_bytes(n, binary=True, digits=2)


# ----------------------------------------------------------------------------------------------------------------
@command("inspect")
def _inspect(p: argparse.ArgumentParser):
    """Architecture, layers, bits/codebook histogram, bytes by group, effective bits per weight."""
    p.add_argument("pack", help="EXL3 model directory")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    def run(a: argparse.Namespace) -> int:
        from ..format.summary import summarize

        s = summarize(Pack.open(a.pack))
        if a.json:
            print(json.dumps(s.to_json(), indent=2))
            return 0
        console.print(f"[bold]{s.path}[/]")
        console.print(f"architecture {s.architecture} ({s.model_type}), {s.num_layers} layers, hidden {s.hidden_size}"
                      + (f", {s.num_experts} experts (top-{s.experts_per_token})" if s.num_experts else ""))
        console.print("quantization " + ", ".join(f"{k}={v}" for k, v in s.quantization.items()))
        hist = Table(title="EXL3 tensors by bits and codebook")
        hist.add_column("bits codebook")
        hist.add_column("tensors", justify="right")
        for k, v in s.bits_histogram.items():
            hist.add_row(k, str(v))
        console.print(hist)
        t = Table(title="bytes by group")
        for col in ("group", "tensors", "bytes", "bits/weight"):
            t.add_column(col, justify="left" if col == "group" else "right")
        for name, g in s.groups.items():
            t.add_row(name, str(g.tensors), _gib(g.bytes), f"{g.bits_per_weight:.3f}")
        t.add_row("unquantized", str(s.unquantized_tensors), _gib(s.unquantized_bytes), "-")
        t.add_row("[bold]total[/]", "", _gib(s.total_bytes), f"{s.exl3_bits_per_weight:.3f} (EXL3 only)")
        console.print(t)
        return 0

    return run


@command("verify")
def _verify(p: argparse.ArgumentParser):
    """Full structural validation of every file and tensor; exit 0 when the pack is sound, 1 otherwise."""
    p.add_argument("pack", help="EXL3 model directory")

    def run(a: argparse.Namespace) -> int:
        from ..format.pack import verify_pack

        pack, problems = verify_pack(a.pack)
        for e in problems:
            err_console.print(f"[red]FAIL[/] {e}", highlight=False, soft_wrap=True)
        if problems:
            err_console.print(f"{len(problems)} problem(s) in {a.pack}")
            return 1
        n = len(pack.linears())
        console.print(f"[green]OK[/] {a.pack}: {len(pack.files)} file(s), {len(pack.tensors)} tensors, "
                      f"{n} EXL3 linears")
        return 0

    return run


@command("dequant")
def _dequant(p: argparse.ArgumentParser):
    """Write decoded weights as `<linear prefix>.weight` to a safetensors file."""
    p.add_argument("pack", help="EXL3 model directory")
    p.add_argument("-o", "--output", required=True, help="output .safetensors file")
    p.add_argument("--tensor", metavar="GLOB", help="only linears whose prefix (or prefix.weight) matches")
    p.add_argument("--rotated", action="store_true",
                   help="write Ŵ (fp16, (in, out), padded), bit-exact with ExLlamaV3's reconstruct")
    p.add_argument("--padded", action="store_true", help="keep the padded geometry in full-weight mode")

    def run(a: argparse.Namespace) -> int:
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

        from ..format import dequant

        pack = Pack.open(a.pack)
        items = dequant.plan(pack, a.tensor, a.rotated, a.padded)
        if not items:
            err_console.print(f"no EXL3 linear matches {a.tensor!r}")
            return 1
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                      console=err_console, disable=not err_console.is_terminal) as prog:
            task = prog.add_task("dequantizing", total=len(items))
            nbytes = dequant.write(items, a.output, a.rotated, progress=lambda _: prog.advance(task))
        console.print(f"wrote {len(items)} tensors ({_gib(nbytes)}) to {a.output}")
        return 0

    return run


@command("launch")
def _launch(p: argparse.ArgumentParser):
    """Check the pack, network and memory, then run `vllm serve` for a role (single, head, worker) and preset."""
    from ..appliance import launch

    launch.add_arguments(p)
    return launch.run


@command("serve")
def _serve(p: argparse.ArgumentParser):
    """Serve an EXL3 pack with vLLM's OpenAI server; --demo serves the bundled tiny pack (CPU is fine)."""
    p.add_argument("pack", nargs="?", help="EXL3 model directory (omit with --demo)")
    p.add_argument("--demo", action="store_true", help="serve the bundled tiny EXL3 pack")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--once", action="store_true", help="answer the demo requests, then stop the server")
    p.add_argument("--boot-timeout", type=float, default=600, help="seconds to wait for /health")
    p.add_argument("vllm_args", nargs=argparse.REMAINDER, help="after --: extra `vllm serve` arguments")

    def run(a: argparse.Namespace) -> int:
        import subprocess

        from . import serve
        from ..format.pack import verify_pack

        extra = tuple(x for x in a.vllm_args if x != "--")
        if a.demo == bool(a.pack):
            err_console.print("give a PACK directory or --demo")
            return 2
        opts = serve.ServeOptions.for_demo(a.host, a.port, extra) if a.demo else \
            serve.ServeOptions(Path(a.pack), a.host, a.port, extra_args=extra)
        _, problems = verify_pack(opts.pack)
        for e in problems:
            err_console.print(f"[red]refusing to serve:[/] {e}", highlight=False, soft_wrap=True)
        if problems:
            return 1
        model = opts.served_name or str(opts.pack)
        base = f"http://{opts.host}:{opts.port}"
        console.print(f"starting vLLM on {opts.pack} -> {base}", highlight=False)
        proc = subprocess.Popen(serve.server_command(opts), env=serve.server_env(), start_new_session=True)
        try:
            t0 = time.monotonic()
            serve.wait_healthy(base, proc, a.boot_timeout)
            console.print(f"[green]healthy[/] after {time.monotonic() - t0:.1f} s; model {model!r}")
            for kind, text, seconds in serve.demo_requests(base, model):
                console.print(f"[bold]{kind}[/] ({seconds:.2f} s): {text!r}", highlight=False)
            if a.once:
                return 0
            console.print(f"serving at {base}/v1 (Ctrl-C to stop)")
            return proc.wait()
        except KeyboardInterrupt:
            return 0
        finally:
            serve.stop(proc)

    return run


@command("info")
def _info(p: argparse.ArgumentParser):
    """Kernel backends this install can run (and why not), the native build's targets, the CUDA devices."""
    p.add_argument("--json", action="store_true", help="machine-readable output")

    def run(a: argparse.Namespace) -> int:
        from .info import collect

        info = collect()
        if a.json:
            print(json.dumps(info.to_json(), indent=2))
            return 0
        console.print(f"vllm-exl3 {info.version}, torch {info.torch} (CUDA {info.torch_cuda or 'none'}), "
                      f"VLLM_EXL3_KERNEL={info.kernel_env}")
        for d in info.devices or ["no CUDA device"]:
            console.print(f"  {d}")
        t = Table(title="kernel backends (auto prefers them in this order)")
        for col in ("backend", "available", "why not"):
            t.add_column(col)
        for b in info.backends:
            t.add_row(b.name, "[green]yes[/]" if b.available else "[red]no[/]", b.reason or "")
        console.print(t)
        if info.native_build:
            console.print(f"native build: {info.native_build}")
        return 0

    return run


@command("load-bench")
def _load_bench(p: argparse.ArgumentParser):
    """Cold-cache read GB/s of a pack on this disk: raw sequential reads, then `--load-format exl3_parallel`'s
    reader at each worker count (each tensor copied to the GPU when there is one, as vLLM does), in back-to-back
    pairs repeated round the worker counts, so a drifting disk moves both sides of each ratio."""
    p.add_argument("pack", help="model directory (or one .safetensors file)")
    p.add_argument("--workers", default="1,8", help="comma-separated worker counts (default 1,8)")
    p.add_argument("--chunk-mib", type=int, help="read size per request")
    p.add_argument("--ring-mib", type=int, help="read-ahead bound")
    p.add_argument("--direct-io", action=argparse.BooleanOptionalAction, default=None,
                   help="O_DIRECT reads (default on, or VLLM_EXL3_LOAD_DIRECT_IO)")
    p.add_argument("--limit-gb", type=float, help="measure only the first files holding this many GB")
    p.add_argument("--device", help="where tensors land (default: cuda if available, else cpu)")
    p.add_argument("--safetensors", action="store_true", help="also measure the safetensors (mmap) default")
    p.add_argument("--repeats", type=int, default=3, help="pairs (raw reads, reader) per worker count; medians")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    def run(a: argparse.Namespace) -> int:
        import torch

        from ..loader import bench as loadbench
        from ..format.units import GB
        from ..loader.options import ReaderOptions

        config = {k: v for k, v in (("chunk_mib", a.chunk_mib), ("ring_mib", a.ring_mib),
                                    ("direct_io", a.direct_io)) if v is not None}
        base = ReaderOptions.from_config(config)
        workers = [int(w) for w in a.workers.split(",")]
        device = torch.device(a.device) if a.device else loadbench.default_device()
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


# ----------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-exl3", description="EXL3 packs on vLLM: inspect, verify, serve.")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, setup in _COMMANDS.items():
        sp = sub.add_parser(name, help=(setup.__doc__ or "").strip().splitlines()[0],
                            description=(setup.__doc__ or "").strip())
        sp.set_defaults(handler=setup(sp))
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    try:
        return args.handler(args)
    except Exl3FormatError as e:
        err_console.print(f"[red]error:[/] {e}", highlight=False, soft_wrap=True)
        return 1


if __name__ == "__main__":
    sys.exit(main())
