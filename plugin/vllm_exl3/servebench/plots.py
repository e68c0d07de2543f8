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
    # What to trust leads: the server's own ms per decode step (its clock, no network or client scheduling in it);
    # the client's decode speed only where a server reports no vLLM metrics.
    server = all(rep._server(report, s, c, n).get("ms_per_step") for s in sides for n in names)
    left = ((lambda s, n: rep._server(report, s, c, n).get("ms_per_step")), "server ms per decode step (lower is better)") \
        if server else ((lambda s, n: cats[s][n]["decode_tok_s"]), "client decode tok/s per request (higher is better)")
    right = ((lambda s, n: cats[s][n]["ttft_ms"]), "client mean TTFT, ms (lower is better)")
    for ax, (value, unit) in ((axes[0], left), (axes[1], right)):
        for i, s in enumerate(sides):
            xs = [j + (i - (len(sides) - 1) / 2) * width for j in range(len(names))]
            ax.bar(xs, [value(s, n) or 0 for n in names], width, label=_label(report, s),
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
    """Against concurrency, one line per side: the server's tok/s of all requests together (left) and its ms per
    decode step (right), from its /metrics; the client's tok/s where a server reports no vLLM metrics."""
    plt = _pyplot()
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.5))
    drawn: set[int] = set()
    client_only = False
    for i, s in enumerate(report["sides"]):
        phases = rep.phases(report, s)
        server = {c: p.get("server") or {} for c, p in phases.items()}
        if all(v.get("tokens_per_s") for v in server.values()) and server:
            values = ({c: v["tokens_per_s"] for c, v in server.items()},
                      {c: v.get("ms_per_step") for c, v in server.items()})
        else:
            client_only = True
            ph = {c: rep.summary(p) for c, p in phases.items()}
            values = ({c: v["aggregate_tok_s"] for c, v in ph.items()}, {c: v["decode_tok_s"] for c, v in ph.items()})
        levels = sorted(c for c, v in values[0].items() if v)
        if not levels:
            continue
        drawn.update(levels)
        label = _label(report, s)
        for ax, series in zip(axes, values):
            ax.plot(levels, [series[c] for c in levels], marker="o", label=label,
                    color=COLOURS[i % len(COLOURS)])
    if not drawn:
        plt.close(fig)
        return None
    titles = (("client tok/s, all requests together", "client decode tok/s per request") if client_only else
              ("server tok/s, all requests together", "server ms per decode step (lower is better)"))
    for ax, title in zip(axes, titles):
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
