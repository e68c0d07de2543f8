"""The pack commands: `inspect`, `verify [--deep]`, `pack index|config|overlay`, `dequant` (the work is format/'s)."""

from __future__ import annotations

import argparse
import json
from dataclasses import asdict
from pathlib import Path

from rich.table import Table

from ..format.pack import Pack
from .common import UsageError, console, err_console, gib, lit, progress_bar
from .userfiles import new_output_folder, output_file, user_path, written_atomically


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


def inspect(p: argparse.ArgumentParser):
    """Family and whether it is served (and why not), architecture, layers, bits/codebook histogram, bytes by group,
    effective bits per weight. Exit 1 when the pack would be refused."""
    p.add_argument("pack", help="EXL3 model directory")
    p.add_argument("--json", action="store_true", help="machine-readable output")

    def run(a: argparse.Namespace) -> int:
        from ..format.summary import summarize, support

        pack = Pack.open(a.pack)
        if not pack.has_exl3_tensors:
            open_exl3_pack(a.pack)  # a plain model: its clear refusal
        if pack.linear_problems():  # nothing to count: say why it is refused
            s, counted = support(pack), None
        else:
            counted = summarize(pack, with_support=True)
            s = counted.support
        if a.json:
            print(json.dumps(counted.to_json() if counted else {"path": str(pack.root), "support": asdict(s)},
                             indent=2))
            return 0 if s.served else 1
        console.print(f"[bold]{lit(str(pack.root))}[/]")
        console.print(lit(f"family       {s.family or 'none known'}: ") + ("[green]served[/]" if s.served else
                                                                          "[red]refused[/]"), soft_wrap=True)
        for note in s.notes:
            console.print(lit(f"  note       {note}"), highlight=False, soft_wrap=True)
        if counted is not None:
            _print_summary(counted)
        for reason in s.reasons:  # as `verify` says them
            err_console.print(f"[red]FAIL[/] {lit(reason)}", highlight=False, soft_wrap=True)
        if not s.served:
            err_console.print(f"refused: {len(s.reasons)} problem(s) in {lit(a.pack)}", highlight=False,
                              soft_wrap=True)
        return 0 if s.served else 1

    return run


def _print_summary(s) -> None:
    """inspect's tables (a format.summary.PackSummary)."""
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
        t.add_row(name, str(g.tensors), gib(g.bytes), f"{g.bits_per_weight:.3f}")
    t.add_row("unquantized", str(s.unquantized_tensors), gib(s.unquantized_bytes), "-")
    t.add_row("[bold]total[/]", "", gib(s.total_bytes), f"{s.exl3_bits_per_weight:.3f} (EXL3 only)")
    console.print(t)


def verify(p: argparse.ArgumentParser):
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


def _verify_deep(pack: Pack) -> int:
    from ..format import deep

    prog, task = progress_bar(deep.count(pack), "decoding")
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


def pack(p: argparse.ArgumentParser):
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
            prog, task = progress_bar(len(list(Path(a.dir).glob("*.safetensors"))), "reading headers")
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
            console.print(f"wrote {lit(path)}: {len(weight_map)} tensors, {gib(total)}", highlight=False)
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
        prog, task = progress_bar(None, "linking / writing shards")
        with prog, new_output_folder(a.output, "-o"):
            result = packtools.overlay(a.experts_pack, a.dense_source, a.output, a.symlink,
                                       progress=lambda _: prog.advance(task))
        for note in result.notes:
            console.print(f"note: {lit(note)}", highlight=False, soft_wrap=True)
        console.print(f"[green]OK[/] {lit(result.out)}: {len(result.linked)} shard(s) "
                      f"{'symlinked' if a.symlink else 'hardlinked'}, {len(result.written)} written "
                      f"({gib(result.copied_bytes)} copied), verified", highlight=False)
        return 0

    return run


def dequant(p: argparse.ArgumentParser):
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
            prog, task = progress_bar(len(items), "dequantizing")
            with prog:
                nbytes = dequant.write(items, partial, a.rotated, progress=lambda _: prog.advance(task))
        console.print(f"wrote {len(items)} tensors ({gib(nbytes)}) to {lit(a.output)}", highlight=False)
        return 0

    return run
