"""The report's PNG plots (matplotlib, drawn off-screen): per category tok/s and TTFT for each side, and tok/s
against concurrency."""

from __future__ import annotations

from pathlib import Path

from . import report as rep

COLOURS = ("#1f77b4", "#ff7f0e")
DPI = 120


def _pyplot():
    import matplotlib

    matplotlib.use("Agg")  # files only: no display on a server or in CI
    import matplotlib.pyplot as plt

    return plt


def categories_png(report: dict, path: Path) -> Path | None:
    """Grouped bars per category: decode tok/s (left) and mean TTFT (right), one bar per side."""
    c = rep.first_level(report)
    if c is None:
        return None
    plt = _pyplot()
    sides = list(report["sides"])
    cats = {s: rep.by_category(report, s, c) for s in sides}
    names = [n for n in report["workload"]["categories"] if all(n in cats[s] for s in sides)]
    if not names:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    width = 0.8 / len(sides)
    for ax, key, unit in ((axes[0], "decode_tok_s", "decode tok/s per request (higher is better)"),
                          (axes[1], "ttft_ms", "mean TTFT, ms (lower is better)")):
        for i, s in enumerate(sides):
            xs = [j + (i - (len(sides) - 1) / 2) * width for j in range(len(names))]
            ax.bar(xs, [cats[s][n][key] or 0 for n in names], width, label=_label(report, s),
                   color=COLOURS[i % len(COLOURS)])
        ax.set_xticks(range(len(names)), names, rotation=30, ha="right")
        ax.set_title(unit)
        ax.grid(axis="y", alpha=0.3)
        ax.legend()
    fig.suptitle(_title(report, f"per category, concurrency {c}"))
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def concurrency_png(report: dict, path: Path) -> Path | None:
    """tok/s against concurrency: all requests together (left), per request (right), one line per side."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    drawn: set[int] = set()
    for i, s in enumerate(report["sides"]):
        ph = {c: rep.summary(p) for c, p in rep.phases(report, s).items()}
        levels = sorted(c for c, summary in ph.items() if summary["aggregate_tok_s"])
        if not levels:
            continue
        drawn.update(levels)
        label = _label(report, s)
        for ax, key in ((axes[0], "aggregate_tok_s"), (axes[1], "decode_tok_s")):
            ax.plot(levels, [ph[c][key] for c in levels], marker="o", label=label,
                    color=COLOURS[i % len(COLOURS)])
    if not drawn:
        plt.close(fig)
        return None
    for ax, title in ((axes[0], "tok/s, all requests together"), (axes[1], "decode tok/s per request")):
        ax.set_xscale("log", base=2)
        ax.set_xticks(sorted(drawn), [str(c) for c in sorted(drawn)])
        ax.set_xlabel("concurrent requests")
        ax.set_title(title)
        ax.set_ylim(bottom=0)
        ax.minorticks_off()
        ax.grid(alpha=0.3)
        ax.legend()
    fig.suptitle(_title(report, "against concurrency"))
    fig.tight_layout()
    fig.savefig(path, dpi=DPI)
    plt.close(fig)
    return path


def _label(report: dict, side: str) -> str:
    label = report["sides"][side]["label"]
    return side if label == side else f"{side}: {label}"


def _title(report: dict, what: str) -> str:
    models = sorted({s["model"] for s in report["sides"].values()})
    return f"{'PARTIAL: ' if report['partial'] else ''}{', '.join(models)}: {what}"
