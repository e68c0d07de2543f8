"""The serving table of one harness run: every [[serve]] row that bench/gpu/run.py measured, side by side, each
against the base row of its model shape (vLLM's own GPTQ 4-bit by default): the server's ms per decode step and decode tokens/s at each
concurrency, prefill tokens/s at each long-prompt length, the boot time, and the idle servers beside it; then, where
servers ran 2-5 sequences, those steps as speculative decoding's verify steps (their cost and break-even acceptance
rate); then, where the run profiled its servers (the `profile` step), their device time per decode step by kernel class.

    python3 bench/gpu/table.py RESULTS_DIR [--base LABEL ...] [--out FILE.md]

RESULTS_DIR holds run.py's serve-LABEL.json rows, bench-LABEL/results.json runs (its $OUT/results.tgz, unpacked;
results.json.gz as committed) and profile-LABEL.json windows (bench/gpu/stepprofile.py). A row's base is the --base row served on the same pack shape and depth.
Every number comes from those files; a row that did not run says why.
"""

from __future__ import annotations

import argparse
import gzip
import json
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "plugin"))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from spark_model import break_even  # noqa: E402
from vllm_exl3.servebench import report as rep  # noqa: E402


def load_rows(results: Path) -> dict[str, dict]:
    """label -> {'row': its serve-LABEL.json, 'run': its bench results.json or None}, in file order."""
    rows = {}
    for f in sorted(results.glob("serve-*.json")):
        row = json.loads(f.read_text())
        rows[row["label"]] = {"row": row, "run": _saved_run(results / f"bench-{row['label']}"),
                              "graphs": _logged_graph_sizes(results / f"server-{row['label']}.log")}
    return rows


def _logged_graph_sizes(log: Path) -> list[int] | None:
    """The CUDA graph sizes the server captured, as vLLM logged its compilation config (the last one logged, the
    engine's own); None without a log that says."""
    logged = re.findall(r"'cudagraph_capture_sizes': \[([0-9, ]+)\]", log.read_text(errors="replace")) \
        if log.is_file() else []
    return [int(v) for v in logged[-1].split(",")] if logged else None


def _saved_run(folder: Path) -> dict | None:
    if (folder / "results.json").exists():
        return json.loads((folder / "results.json").read_text())
    if (folder / "results.json.gz").exists():
        return json.loads(gzip.decompress((folder / "results.json.gz").read_bytes()))
    return None


def shape(row: dict) -> tuple:
    """The model a row served: its pack's shape and depth (a GPTQ or fp16 row names the pack it copies)."""
    pack = row.get("pack") or {}
    return pack.get("shape"), pack.get("layers")


def decode(run: dict) -> dict[int, dict]:
    """concurrency -> the server's numbers of that phase (ms/step, decode tok/s, tokens/step)."""
    return {c: (p.get("server") or {}) for c, p in rep.phases(run, "A").items()}


def prefill(run: dict) -> dict[int, float | None]:
    return {p["prefill_length"]: (p.get("server") or {}).get("prefill_tokens_per_s") for p in rep.prefill_phases(run)}


def _f(x: float | None, digits: int = 2) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def table(rows: dict[str, dict], bases: list[str]) -> list[str]:
    ok = {label: r for label, r in rows.items() if r["run"] is not None}
    levels = sorted({c for r in ok.values() for c in decode(r["run"])})
    lengths = sorted({n for r in ok.values() for n in prefill(r["run"])})
    head = (["server", "base", "boot s"] + [f"c{c} ms/step (× base)" for c in levels]
            + [f"c{c} tok/s (all)" for c in levels] + [f"prefill {n} tok/s (× base)" for n in lengths])
    lines = ["| " + " | ".join(head) + " |", "|---|---|" + "---:|" * (len(head) - 2)]
    for label, r in ok.items():
        base = next((b for b in bases if b in ok and shape(ok[b]["row"]) == shape(r["row"])), None)
        base_dec = decode(ok[base]["run"]) if base else {}
        base_pre = prefill(ok[base]["run"]) if base else {}
        dec, pre = decode(r["run"]), prefill(r["run"])
        cells = [label, base or "–", _f(r["row"].get("boot_s"), 0)]
        for c in levels:
            ms, b = dec.get(c, {}).get("ms_per_step"), base_dec.get(c, {}).get("ms_per_step")
            cells.append(f"{_f(ms)} ({_f(ms / b if ms and b else None)})")
        cells += [_f(dec.get(c, {}).get("tokens_per_s"), 0) for c in levels]
        for n in lengths:
            t, b = pre.get(n), base_pre.get(n)
            cells.append(f"{_f(t, 0)} ({_f(t / b if t and b else None)})")
        lines.append("| " + " | ".join(cells) + " |")
    not_run = [f"- `{label}`: {r['row'].get('error') or 'no bench results'}" for label, r in rows.items()
               if r["run"] is None]
    beside = [f"- `{label}` was measured with {', '.join(r['row']['idle_servers_beside'])} idle beside it"
              for label, r in ok.items() if r["row"].get("idle_servers_beside")]
    return lines + ([""] + beside if beside else []) + (["", "Not measured:"] + not_run if not_run else [])


def graph_rows(r: dict, n: int) -> int | None:
    """The CUDA graph a decode step of n sequences ran on a server (a load_rows entry): the smallest captured size
    >= n, from the sizes its log names, else from the --compilation-config it was given. None where no graph holds n
    rows (the step ran eagerly) or neither says which graphs it captured."""
    sizes = r.get("graphs")
    argv = r["row"].get("argv", [])
    if sizes is None and "--compilation-config" in argv:
        sizes = json.loads(argv[argv.index("--compilation-config") + 1]).get("cudagraph_capture_sizes")
    return min((s for s in sizes if s >= n), default=None) if sizes else None


def verify_table(rows: dict[str, dict]) -> list[str]:
    """Speculative decoding's verify shapes (issue #45): a step that verifies k drafts of one sequence runs k + 1 rows
    through every layer, as a plain step of k + 1 sequences does (the KV cache read differs: k + 1 short contexts
    instead of one). Per server measured at 1 and k + 1 sequences: that step over the 1-sequence step, and the
    acceptance rate at which k free drafts (n-gram lookup; a draft model adds its own cost) pay for it
    (spark_model.break_even). A server whose CUDA graphs padded k + 1 sequences to more rows (graph_rows) measured
    that many rows: the cell says so, since a real verify step runs exactly k + 1 (vLLM rounds its graph sizes to
    multiples of k + 1 under speculative decoding). [] when no server ran 2-5 sequences."""
    ks = sorted({c - 1 for r in rows.values() if r["run"] for c in decode(r["run"]) if 2 <= c <= 5})
    lines = []
    for label, r in rows.items():
        dec = decode(r["run"]) if r["run"] else {}
        one = dec.get(1, {}).get("ms_per_step")
        if not one or not any(dec.get(k + 1, {}).get("ms_per_step") for k in ks):
            continue
        cells = [label, _f(one)]
        for k in ks:
            ms = dec.get(k + 1, {}).get("ms_per_step")
            a = break_even(k, ms / one) if ms else None
            ran = graph_rows(r, k + 1)
            padded = f", padded to {ran} rows" if ran not in (None, k + 1) else ""
            cells.append("–" if not ms else f"{ms / one:.3f} ({'never' if a is None else f'{a:.2f}'}{padded})")
        lines.append("| " + " | ".join(cells) + " |")
    if not lines:
        return []
    return (["", "Verify-sized steps: the step at k + 1 sequences over the 1-sequence step (the break-even acceptance "
             "rate of k free drafts):", "", "| server | c1 ms/step | " + " | ".join(f"k = {k}" for k in ks) + " |",
             "|---|---:|" + "---:|" * len(ks)] + lines)


def profile_table(results: Path) -> list[str]:
    """One column per profiled server and concurrency, one row per kernel class (exclusive device µs per step, the
    classes in order of their largest value), then the busy total, the overlapping (inclusive) sum and the server's
    step under the profiler; [] when the run profiled nothing."""
    cols: list[tuple[str, dict]] = []
    for f in sorted(results.glob("profile-*.json")):
        prof = json.loads(f.read_text())
        for w in prof.get("windows", []):
            if "us_per_step" in w and "inclusive_us_per_step" not in w:  # profiled before exclusive counting
                w = {**w, "us_per_step": None, "inclusive_us_per_step": w["us_per_step"]}
                cols.append((f"{prof['label']} c{w['concurrency']} †", w))
            else:
                cols.append((f"{prof['label']} c{w['concurrency']}", w))
    if not cols:
        return []
    largest: dict[str, float] = {}
    for _, w in cols:
        for cls, us in (w.get("by_class_us_per_step") or {}).items():
            largest[cls] = max(largest.get(cls, 0.0), us)
    rows = [[cls] + [_f((w.get("by_class_us_per_step") or {}).get(cls), 0) for _, w in cols]
            for cls in sorted(largest, key=lambda c: -largest[c])]
    rows.append(["**device busy**"] + [_f(w.get("us_per_step"), 0) for _, w in cols])
    rows.append(["kernels' durations summed (overlapping)"] + [_f(w.get("inclusive_us_per_step"), 0) for _, w in cols])
    rows.append(["the server's step under the profiler"] +
                [_f(w["server_ms_per_step"] * 1e3 if w.get("server_ms_per_step") else None, 0) for _, w in cols])
    errors = [f"- `{name}`: {w['error']}" for name, w in cols if w.get("error")]
    dagger = (["", "† profiled before kernels were counted exclusive of their stream's overlap: the class times of "
               "these columns overlap (kernels launched early by PDL count their wait), so they add up to more than "
               "the busy time"] if any(name.endswith("†") for name, _ in cols) else [])
    return (["", "Device time per decode step by kernel class (µs, each kernel exclusive of what its stream already "
             "covered; profile-*.json):", "", "| class | " + " | ".join(name for name, _ in cols) + " |",
             "|---|" + "---:|" * len(cols)] + ["| " + " | ".join(r) + " |" for r in rows]
            + dagger + (["", "Profile windows with errors:"] + errors if errors else []))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("results", type=Path)
    ap.add_argument("--base", action="append", help="a base row's label (repeatable; default gptq-4b-vllm and "
                    "glm-gptq-4b-vllm): each row is set against the base served on its pack shape")
    ap.add_argument("--out", type=Path)
    a = ap.parse_args()
    rows = load_rows(a.results)
    if not rows:
        sys.exit(f"{a.results}: no serve-*.json rows (is this an unpacked results.tgz of bench/gpu/run.py?)")
    text = "\n".join(table(rows, a.base or ["gptq-4b-vllm", "glm-gptq-4b-vllm"]) + verify_table(rows)
                     + profile_table(a.results)) + "\n"
    if a.out:
        a.out.write_text(text)
    print(text, end="")
    return 0


if __name__ == "__main__":
    sys.exit(main())
