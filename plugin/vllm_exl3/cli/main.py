"""`vllm-exl3` command line: parse arguments, call the modules that do the work, render the result."""

from __future__ import annotations

import argparse
import errno
import json
import os
import shutil
import sys
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

from rich.console import Console
from rich.markup import escape
from rich.table import Table

from .. import __version__
from ..format.errors import Exl3FormatError
from ..format.pack import Pack
from ..format.units import format_bytes

console = Console()
err_console = Console(stderr=True)

_COMMANDS: dict[str, Callable[[argparse.ArgumentParser], Callable[[argparse.Namespace], int]]] = {}
# Commands whose extra arguments, after `--`, go to vLLM.
_TAKES_VLLM_ARGS = {"serve", "launch", "preflight"}


class UsageError(Exception):
    """A mistake the user can fix: printed as one paragraph (no traceback), exit status `code`."""

    def __init__(self, message: str, code: int = 1):
        super().__init__(message)
        self.code = code


def command(name: str):
    """Register `fn(parser) -> handler` as the subcommand `name`."""

    def deco(fn):
        _COMMANDS[name] = fn
        return fn

    return deco


def _gib(n: int) -> str:
    return format_bytes(n, binary=True, digits=2)


def lit(value: object) -> str:
    """`value` as text that Rich prints as it is. Tensor names, config strings, error messages and paths come from
    a pack or the command line: a tensor named '[/]' is not markup (Rich would stop with a MarkupError)."""
    return escape(str(value))


def open_exl3_pack(path: str, finite: bool = False) -> Pack:
    """Pack.open and Pack.check (what serving checks but the scales, unless `finite`), after a clear refusal of a
    model directory that holds no EXL3 tensors (a plain HF model)."""
    pack = Pack.open(path)
    if not pack.has_exl3_tensors:
        method = pack.quantization_config.get("quant_method")
        raise UsageError(f"{path} is not an EXL3 pack: none of its tensors is EXL3-quantized (no .trellis tensors)"
                         + (f" and its quantization_config says quant_method {method!r}" if method else
                            " and its config.json has no quantization_config")
                         + ". Convert the model with ExLlamaV3's convert.py, or point at an EXL3 download.")
    pack.check(finite)
    return pack


def output_file(path: str) -> str:
    """An output file path whose folder exists (checked before any work is done)."""
    parent = Path(path).expanduser().resolve().parent
    if Path(path).is_dir():
        raise UsageError(f"-o {path} is a directory; give a file name, e.g. {Path(path) / 'weights.safetensors'}")
    if not parent.is_dir():
        raise UsageError(f"-o {path}: the folder {parent} does not exist; create it first (mkdir -p {parent})")
    return path


# What the operating system can refuse about a user's file or folder, and what the user can do about it: the
# user's environment, never a bug of ours, wherever in a command it surfaces (main() reports these as one line).
PATH_ADVICE = {  # about the path the error names (the same errors without a path are about something else)
    errno.EACCES: "check the permissions of the file and its folder, or choose another path",
    errno.EPERM: "check the permissions of the file and its folder, or choose another path",
    errno.EROFS: "it is on a read-only filesystem: choose a path on a writable one",
    errno.ENAMETOOLONG: "choose a shorter path",
    errno.ELOOP: "the path runs in a loop of symbolic links",
}
DISK_ADVICE = {  # about a disk, even where the system names no path (a write to an open file)
    errno.ENOSPC: "the disk is full: free space, or choose a path on another disk",
    errno.EDQUOT: "the disk quota is used up: free space, or choose a path on another disk",
    errno.EFBIG: "the file would exceed the filesystem's or the shell's file-size limit (ulimit -f)",
    errno.EIO: "the device reported an I/O error: check the disk (dmesg)",
}
OS_ADVICE = {**PATH_ADVICE, **DISK_ADVICE}


def _path_name(path) -> str:
    return os.fsdecode(path) if isinstance(path, (str, bytes, os.PathLike)) else str(path)


def environment_error(e: OSError) -> bool:
    """Whether an OSError is the user's environment (a file or disk refused), not a bug of ours."""
    return e.errno in DISK_ADVICE or (e.errno in PATH_ADVICE and e.filename is not None)


def os_error(e: OSError, path: str | os.PathLike | None = None, action: str | None = None) -> UsageError:
    """An OSError about a user's file as one paragraph: what could not be done to which path, the system's
    reason, and what to do (OS_ADVICE). `path`, `action`: the user's own path and what the command was doing
    with it, where known (else the path the system names)."""
    target = path if path is not None else e.filename
    what = None if target is None else f"cannot {action} {_path_name(target)}" if action else _path_name(target)
    advice = OS_ADVICE.get(e.errno)
    return UsageError((f"{what}: " if what else "") + f"{e.strerror or e}" + (f"; {advice}" if advice else ""))


@contextmanager
def user_path(path: str | os.PathLike, action: str, own: Path | None = None) -> Iterator[None]:
    """OSErrors raised inside, while `action` (e.g. "write -o") is done to the user's `path`, become one
    UsageError naming it. `own`: the folder all the files written inside live in; an error that names a file
    outside it (a pack file being read) is left to main()'s rule, which names that file."""
    try:
        yield
    except BrokenPipeError:
        raise
    except OSError as e:
        if own is not None and isinstance(e.filename, (str, bytes, os.PathLike)) and \
                not Path(os.fsdecode(e.filename)).resolve().is_relative_to(own.resolve()):
            raise
        raise os_error(e, path, action) from e


@contextmanager
def written_atomically(path: str, flag: str) -> Iterator[Path]:
    """A temporary path for the command to write `path` to: in a folder of its own made beside `path` at once
    (so a folder the user cannot write is refused before any work), moved onto `path` when the body succeeds (no
    reader sees half a file; a file already at `path` survives a failed run); the temporary folder, with
    anything half-written in it, is removed either way."""
    target = Path(path).expanduser()
    with user_path(path, f"write {flag}"):
        folder = Path(tempfile.mkdtemp(prefix=f".{target.name}.", suffix=".partial", dir=target.parent))
    try:
        with user_path(path, f"write {flag}", own=folder):
            yield folder / target.name
            os.replace(folder / target.name, target)
    finally:
        shutil.rmtree(folder, ignore_errors=True)


@contextmanager
def new_output_folder(path: str, flag: str) -> Iterator[None]:
    """OSErrors while a command fills the new or empty folder `path` become one UsageError naming it; when the
    command fails, what it put there is removed (the folder too, if the command made it). A folder that was
    not new or empty is never touched (the command refuses it)."""
    out = Path(path).expanduser()
    existed = out.exists()
    fresh = not existed or (out.is_dir() and not any(out.iterdir()))
    try:
        with user_path(path, f"write {flag}"):
            yield
    except BaseException:
        if fresh and out.is_dir():
            for child in out.iterdir() if existed else [out]:
                try:
                    shutil.rmtree(child) if child.is_dir() and not child.is_symlink() else child.unlink()
                except OSError:
                    pass  # the error that stopped the command is the one to report
        raise


def worker_counts(text: str) -> list[int]:
    """`--workers 1,8` -> [1, 8]; anything but positive integers is refused (argparse type)."""
    try:
        counts = [int(w) for w in text.split(",")]
    except ValueError:
        counts = []
    if not counts or min(counts) < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a comma-separated list of positive integers (e.g. 1,8)")
    return counts


# ----------------------------------------------------------------------------------------------------------------
@command("inspect")
def _inspect(p: argparse.ArgumentParser):
    """Architecture, layers, bits/codebook histogram, bytes by group, effective bits per weight."""
    p.add_argument("pack", help="EXL3 model directory")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    def run(a: argparse.Namespace) -> int:
        from ..format.summary import summarize

        s = summarize(open_exl3_pack(a.pack))
        if a.json:
            print(json.dumps(s.to_json(), indent=2))
            return 0
        console.print(f"[bold]{lit(s.path)}[/]")
        console.print(lit(f"architecture {s.architecture} ({s.model_type}), {s.num_layers} layers, hidden "
                          f"{s.hidden_size}" + (f", {s.num_experts} experts (top-{s.experts_per_token})"
                                                if s.num_experts else "")))
        console.print(lit("quantization " + ", ".join(f"{k}={v}" for k, v in s.quantization.items())))
        hist = Table(title="EXL3 tensors by bits and codebook")
        hist.add_column("bits codebook")
        hist.add_column("tensors", justify="right")
        for k, v in s.bits_histogram.items():
            hist.add_row(lit(k), str(v))
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
    p.add_argument("--deep", action="store_true",
                   help="also decode every tensor (streaming): finite values, finite and sane suh/svh; per tensor")

    def run(a: argparse.Namespace) -> int:
        from ..format.pack import verify_pack

        pack, problems = verify_pack(a.pack)
        for e in problems:
            err_console.print(f"[red]FAIL[/] {lit(e)}", highlight=False, soft_wrap=True)
        if problems:
            err_console.print(f"{len(problems)} problem(s) in {lit(a.pack)}", highlight=False, soft_wrap=True)
            return 1
        n = len(pack.linears())
        console.print(f"[green]OK[/] {lit(a.pack)}: {len(pack.files)} file(s), {len(pack.tensors)} tensors, "
                      f"{n} EXL3 linears", highlight=False, soft_wrap=True)
        for note in pack.notes:
            console.print(f"note: {lit(note)}", highlight=False, soft_wrap=True)
        return _verify_deep(pack) if a.deep else 0

    return run


def _progress(total: int, description: str):
    """A progress bar on stderr (hidden when stderr is not a terminal)."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    prog = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeRemainingColumn(),
                    console=err_console, disable=not err_console.is_terminal)
    return prog, prog.add_task(description, total=total)


def _verify_deep(pack: Pack) -> int:
    from ..format import deep

    prog, task = _progress(deep.count(pack), "decoding")
    bad = 0
    with prog:
        for c in deep.check_pack(pack):
            prog.advance(task)
            if c.problem:
                bad += 1
                err_console.print(f"[red]FAIL[/] {lit(c.problem)}", highlight=False, soft_wrap=True)
            else:
                console.print(lit(f"ok   {c.kind:5} {c.name}  max|w| {c.max_abs:.4g}"), highlight=False,
                              soft_wrap=True)
    if bad:
        err_console.print(f"{bad} tensor(s) with bad values in {lit(pack.root)}", highlight=False, soft_wrap=True)
        return 1
    console.print(f"[green]OK[/] every tensor of {lit(pack.root)} decodes to finite values", highlight=False,
                  soft_wrap=True)
    return 0


@command("pack")
def _pack(p: argparse.ArgumentParser):
    """Pack tools: regenerate the index, derive quantization_config, overlay experts onto dense layers."""
    sub = p.add_subparsers(dest="pack_command", required=True)
    ix = sub.add_parser("index", help="regenerate model.safetensors.index.json from the shards' headers")
    ix.add_argument("dir", help="pack directory")
    ix.add_argument("--check", action="store_true", help="report drift without writing (exit 1 on drift)")
    cf = sub.add_parser("config", help="derive quantization_config from the tensors; diff; --write")
    cf.add_argument("dir", help="pack directory")
    cf.add_argument("--write", action="store_true", help="write it into config.json (and the sidecar if any)")
    ov = sub.add_parser("overlay", help="routed experts of one pack + dense layers of another (or of the BF16 model)")
    ov.add_argument("experts_pack", help="EXL3 pack whose routed experts are used")
    ov.add_argument("dense_source", help="EXL3 pack or BF16 model whose other tensors are used")
    ov.add_argument("-o", "--output", required=True, help="new pack directory (must not exist or be empty)")
    ov.add_argument("--symlink", action="store_true", help="symbolic links instead of hardlinks to unchanged shards")

    def run(a: argparse.Namespace) -> int:
        from ..format import packtools

        if a.pack_command == "index":
            if not Path(a.dir).is_dir():
                raise UsageError(f"{a.dir}: no such pack directory")
            prog, task = _progress(len(list(Path(a.dir).glob("*.safetensors"))), "reading headers")
            with prog:
                weight_map, total = packtools.scan_shards(a.dir, progress=lambda _: prog.advance(task))
            drift = packtools.index_drift(a.dir, weight_map)
            for line in drift:
                console.print(lit(line), highlight=False, soft_wrap=True)
            if a.check:
                console.print(f"{len(drift)} difference(s) between the index and the shards" if drift else
                              f"[green]OK[/] the index matches the shards ({len(weight_map)} tensors)")
                return 1 if drift else 0
            with user_path(a.dir, "write model.safetensors.index.json into the pack folder"):
                path = packtools.write_index(a.dir, weight_map, total)
            console.print(f"wrote {lit(path)}: {len(weight_map)} tensors, {_gib(total)}", highlight=False)
            return 0
        if a.pack_command == "config":
            # Headers only, no contract check: fixing a config that contradicts the tensors is this command's job.
            pack = Pack.open(a.dir)
            derived = packtools.derive_config(pack.tensors, pack.quantization_config)
            for note in derived.notes:
                console.print(f"note: {lit(note)}", highlight=False, soft_wrap=True)
            diff = packtools.config_diff(pack.quantization_config, derived.config)
            console.print(diff or "quantization_config already matches the tensors", highlight=False, markup=False)
            if a.write and diff:
                with user_path(a.dir, "write quantization_config into the pack folder"):
                    written = packtools.write_config(a.dir, derived.config)
                for path in written:
                    console.print(f"wrote {lit(path)}", highlight=False)
            return 0
        prog, task = _progress(None, "linking / writing shards")
        with prog, new_output_folder(a.output, "-o"):
            result = packtools.overlay(a.experts_pack, a.dense_source, a.output, a.symlink,
                                       progress=lambda _: prog.advance(task))
        for note in result.notes:
            console.print(f"note: {lit(note)}", highlight=False, soft_wrap=True)
        console.print(f"[green]OK[/] {lit(result.out)}: {len(result.linked)} shard(s) "
                      f"{'symlinked' if a.symlink else 'hardlinked'}, {len(result.written)} written "
                      f"({_gib(result.copied_bytes)} copied), verified", highlight=False)
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
        from ..format import dequant

        output_file(a.output)
        if Path(a.output).expanduser().resolve().is_relative_to(Path(a.pack).expanduser().resolve()):
            raise UsageError(f"-o {a.output} is inside the pack {a.pack}: writing there would change the pack; "
                             "give a path outside it")
        with written_atomically(a.output, "-o") as partial:
            pack = open_exl3_pack(a.pack, finite=True)
            items = dequant.plan(pack, a.tensor, a.rotated, a.padded)
            if not items:
                err_console.print(f"no EXL3 linear matches {lit(repr(a.tensor))} (`vllm-exl3 inspect {lit(a.pack)}` "
                                  "lists the groups; patterns are globs such as 'model.layers.0.*')", highlight=False)
                return 1
            prog, task = _progress(len(items), "dequantizing")
            with prog:
                nbytes = dequant.write(items, partial, a.rotated, progress=lambda _: prog.advance(task))
        console.print(f"wrote {len(items)} tensors ({_gib(nbytes)}) to {lit(a.output)}", highlight=False)
        return 0

    return run


@command("launch")
def _launch(p: argparse.ArgumentParser):
    """Check the pack, network and memory, then run `vllm serve` for a role (single, head, worker) and preset."""
    from ..appliance import launch

    launch.add_arguments(p)
    return launch.run


@command("preflight")
def _preflight(p: argparse.ArgumentParser):
    """The checks `launch` runs before starting vLLM (pack, kernel backend, network, head, memory plan), and the
    command it would run; starts nothing. Exit 0 when launch would start, 78 when it would refuse."""
    from ..appliance import launch

    launch.add_arguments(p, preflight_only=True)
    return launch.run


@command("serve")
def _serve(p: argparse.ArgumentParser):
    """Serve an EXL3 pack with vLLM's OpenAI server; --demo serves the bundled tiny pack (CPU is fine).
    vLLM's own options go after `--`, e.g. `vllm-exl3 serve PACK --port 8011 -- --max-model-len 4096`."""
    p.add_argument("pack", nargs="?", help="EXL3 model directory (omit with --demo)")
    p.add_argument("--demo", action="store_true", help="serve the bundled tiny EXL3 pack")
    p.add_argument("--host", default="127.0.0.1")
    p.add_argument("--port", type=int, default=8000)
    p.add_argument("--once", action="store_true", help="answer the smoke requests, then stop the server")
    p.add_argument("--boot-timeout", type=float, default=600, help="seconds to wait for /health")
    p.add_argument("--log", metavar="FILE", help="vLLM's log (default: a file in the temp folder, printed)")

    def run(a: argparse.Namespace) -> int:
        from .serve import serve_main

        if a.demo == bool(a.pack):
            raise UsageError("give a PACK directory or --demo (the bundled tiny pack), not both or neither", 2)
        return serve_main(a, console, err_console)

    return run


@command("metrics")
def _metrics(p: argparse.ArgumentParser):
    """Serve the EXL3 and Spark-health metrics for Prometheus (docs/observability.md); runs until stopped."""
    from ..appliance.metrics.exporter import add_arguments

    add_arguments(p)

    def run(a: argparse.Namespace) -> int:
        import logging

        from ..appliance.metrics.exporter import serve

        logging.basicConfig(level=logging.INFO, format="%(levelname)s %(asctime)s [%(name)s] %(message)s")
        return serve(a)

    return run


@command("info")
def _info(p: argparse.ArgumentParser):
    """Kernel backends this install can run (and why not), the native build's targets, the CUDA devices, and the
    parity gate's report of each server on this machine (--port: only the server on that API port)."""
    p.add_argument("--json", action="store_true", help="machine-readable output")
    p.add_argument("--port", type=int, help="only the parity report of the server on this API port")

    def run(a: argparse.Namespace) -> int:
        from .info import collect

        info = collect(a.port)
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
        _print_parity(info.parity_reports, a.port)
        return 0

    return run


def _server_label(report: dict) -> str:
    """`port-8000` -> "the server on port 8000" (kernels/parity.py server_key), plus the rank."""
    key, rank = str(report.get("server", "")), report.get("rank", 0)
    what = (f"the server on port {key.removeprefix('port-')}" if key.startswith("port-") else
            "a headless node" if key == "headless" else "an offline engine (no API server)" if key == "offline"
            else "a server")
    return f"{what}, rank {rank}"


def _print_parity(reports: list, port: int | None) -> None:
    from ..kernels.parity import REPORT_ENV, report_dir

    if not reports:
        where = os.environ.get(REPORT_ENV) or report_dir()
        console.print(f"parity gate: no report{f' of a server on port {port}' if port is not None else ''} in "
                      f"{where} (each server writes its own when it loads a pack)", highlight=False)
        return
    # every report of the server asked for; else those of processes that still run, and a line for the rest
    shown = reports if port is not None else [r for r in reports if r.running is not False]
    for r in shown:
        report = r.report
        if report is None:
            console.print(f"parity gate: {r.path} cannot be read ({r.problem})", highlight=False, soft_wrap=True)
            continue
        try:
            line, checks = _parity_summary(report, r.running, r.path)
        except (KeyError, TypeError, ValueError, AttributeError) as e:  # a file edited by hand, or half a copy
            console.print(f"parity gate: {r.path} is not a parity report ({type(e).__name__}: {e})",
                          highlight=False, soft_wrap=True)
            continue
        console.print(line, highlight=False, soft_wrap=True)
        console.print(checks if checks is not None else
                      "  no layer checked (the torch reference serves every layer type)")
    exited = [str(r.report.get("server")) for r in reports if r not in shown]
    if exited:
        console.print(f"parity gate: {len(exited)} more report(s) of processes that have exited "
                      f"({', '.join(exited[:8])}{', ...' if len(exited) > 8 else ''}); "
                      "`vllm-exl3 info --port N` shows one", highlight=False, soft_wrap=True)


def _parity_summary(report: dict, running: bool | None, path: str) -> tuple[str, Table | None]:
    when = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(report.get("time", 0)))
    state = {True: "running", False: "exited", None: "unknown"}[running]
    line = (f"parity gate of {_server_label(report)} (pid {report.get('pid')}, {state}; {when}, policy "
            f"{report.get('policy')}, {report.get('seconds', 0):.3f} s; {path}): "
            + ", ".join(f"{t} -> {b}" for t, b in report.get("served", {}).items()))
    if not report.get("checks"):
        return line, None
    t = Table(title=f"parity checks against the {report.get('reference')} reference")
    for col in ("layer", "layer type", "backend", "rel. error", "bound", "result", "s"):
        t.add_column(col)
    for c in report["checks"]:
        t.add_row(c["layer"], c["layer_type"], c["backend"], f"{c['error']:.2e}", f"{c['bound']:g}",
                  "[green]pass[/]" if c["passed"] else "[red]FAIL[/]", f"{c['seconds']:.3f}")
    return line, t


@command("bench")
def _bench(p: argparse.ArgumentParser):
    """Serving benchmark of an OpenAI-compatible endpoint, or two head to head (--a URL --b URL): eight prompt
    categories, streaming, TTFT, decode tok/s, ITL, E2E per concurrency level, with the server's own /metrics beside
    the client's numbers; writes raw JSON, a Markdown report and PNG plots (docs/bench.md)."""
    from . import bench

    bench.add_arguments(p)
    return bench.run


@command("load-bench")
def _load_bench(p: argparse.ArgumentParser):
    """Cold-cache read GB/s of a pack on this disk: raw sequential reads, then `--load-format exl3_parallel`'s
    reader at each worker count (each tensor copied to the GPU when there is one, as vLLM does), in back-to-back
    pairs repeated round the worker counts, so a drifting disk moves both sides of each ratio."""
    p.add_argument("pack", help="model directory (or one .safetensors file)")
    p.add_argument("--workers", type=worker_counts, default=[1, 8], help="comma-separated worker counts (default 1,8)")
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


# ----------------------------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="vllm-exl3", description="EXL3 packs on vLLM: inspect, verify, serve.")
    parser.add_argument("--version", action="version", version=f"vllm-exl3 {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)
    for name, setup in _COMMANDS.items():
        sp = sub.add_parser(name, help=(setup.__doc__ or "").strip().splitlines()[0],
                            description=(setup.__doc__ or "").strip())
        sp.set_defaults(handler=setup(sp), parser=sp)
    return parser


def parse(argv: list[str]) -> argparse.Namespace:
    """Our options anywhere on the line; everything after the first `--` is vLLM's (serve, launch, preflight).
    An unknown option is reported by the subcommand that was given it, with that subcommand's usage."""
    ours, sep, vllm_args = (argv[:argv.index("--")], ["--"], argv[argv.index("--") + 1:]) if "--" in argv \
        else (argv, [], [])
    parser = build_parser()
    args, unknown = parser.parse_known_args(ours)
    sp: argparse.ArgumentParser = args.parser
    if unknown:
        hint = ""
        if args.command in _TAKES_VLLM_ARGS and any(u.startswith("-") for u in unknown):
            hint = f"; vLLM's own options go after `--`: vllm-exl3 {args.command} ... -- {' '.join(unknown)}"
        sp.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")
    if sep and args.command not in _TAKES_VLLM_ARGS:
        sp.error(f"unexpected `-- {' '.join(vllm_args)}`: {args.command} passes nothing to vLLM")
    args.vllm_args = vllm_args
    return args


def _write_trace() -> Path | None:
    """The current exception's full traceback in a file (for a bug report); None if no file could be written."""
    try:
        fd, name = tempfile.mkstemp(prefix="vllm-exl3-error-", suffix=".txt")
        with os.fdopen(fd, "w") as f:
            f.write(f"vllm-exl3 {__version__}: {' '.join(sys.argv)}\n\n{traceback.format_exc()}")
        return Path(name)
    except OSError:
        return None


class _NamedOutput:
    """sys.stdout while a command runs: a write the system refuses (`> /dev/full`, a full disk) is reported as
    the standard output's, which the system's error (about an open file) does not say."""

    def __init__(self, stream):
        self._stream = stream

    def write(self, text: str) -> int:
        return self._refused(self._stream.write, text)

    def flush(self) -> None:
        self._refused(self._stream.flush)

    @staticmethod
    def _refused(call, *args):
        try:
            return call(*args)
        except BrokenPipeError:
            raise
        except OSError as e:
            _quiet_stdout()  # the rest would fail again when the interpreter exits
            raise os_error(e, "the standard output", "write") from e

    def __getattr__(self, name: str):
        return getattr(self._stream, name)


def _quiet_stdout() -> None:
    """After a broken pipe (`vllm-exl3 inspect --json | head`): discard the rest instead of failing at exit."""
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass


def main(argv: list[str] | None = None) -> int:
    args = parse(sys.argv[1:] if argv is None else list(argv))
    stdout, sys.stdout = sys.stdout, _NamedOutput(sys.stdout)
    try:
        code = args.handler(args)
        sys.stdout.flush()  # a closed pipe or a full disk shows here, handled below, not at interpreter exit
        return code
    except Exl3FormatError as e:
        err_console.print(f"[red]error:[/] {lit(e)}", highlight=False, soft_wrap=True)
        return 1
    except UsageError as e:
        err_console.print(f"[red]error:[/] {lit(e)}", highlight=False, soft_wrap=True)
        return e.code
    except BrokenPipeError:
        _quiet_stdout()
        return 141  # what a shell reports for a command stopped by SIGPIPE
    except KeyboardInterrupt:
        return 130
    except OSError as e:
        if not environment_error(e):
            return _internal_error(e)
        err_console.print(f"[red]error:[/] {lit(os_error(e))}", highlight=False, soft_wrap=True)
        return 1
    except Exception as e:
        return _internal_error(e)
    finally:
        sys.stdout = stdout


def _internal_error(e: Exception) -> int:
    """Anything but the user's input or environment is a bug: one line here, the whole trace in a file."""
    trace = _write_trace()
    err_console.print(f"[red]internal error:[/] {type(e).__name__}: {lit(e)}", highlight=False, soft_wrap=True)
    err_console.print(f"the full trace is in {trace}; please include it in a bug report" if trace else
                      "(the trace could not be written to the temp folder)", highlight=False, soft_wrap=True)
    return 70  # EX_SOFTWARE


if __name__ == "__main__":
    sys.exit(main())
