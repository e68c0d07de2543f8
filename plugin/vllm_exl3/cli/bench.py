"""`vllm-exl3 bench`: parse the options, run servebench against one or two endpoints (or re-render a saved run),
write the raw JSON, the Markdown report and the plots, print the table and the summary line."""

from __future__ import annotations

import argparse
import datetime
import os
from pathlib import Path
from urllib.parse import urlparse

from .common import UsageError, console, err_console, worker_counts

DEFAULT_CONCURRENCY = [1, 2, 4, 8, 16]
RESULTS, REPORT, CATEGORIES_PNG, CONCURRENCY_PNG = "results.json", "report.md", "categories.png", "concurrency.png"
# Exit status of a run that stopped early (its partial report is written all the same).
EXIT_PARTIAL = 3


def _seconds(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive number of seconds")
    return value


def _is_url(text: str) -> bool:
    u = urlparse(text)
    return u.scheme in ("http", "https") and bool(u.netloc)


def _side(text: str) -> str:
    if not _is_url(text) and not Path(text).is_file():
        raise argparse.ArgumentTypeError(f"{text!r} is neither an http(s) URL of a server (e.g. http://spark:8000) "
                                         f"nor a saved run's {RESULTS}")
    return text


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--a", metavar="URL|RESULTS_JSON", type=_side,
                   help=f"the endpoint (e.g. http://spark:8000), side A; or a saved one-endpoint run's {RESULTS}")
    p.add_argument("--b", metavar="URL|RESULTS_JSON", type=_side,
                   help=f"a second endpoint, side B, measured head to head with A; or a saved run's {RESULTS} (its "
                        "workload is then used for both sides)")
    p.add_argument("--a-exporter", metavar="URL", default=None,
                   help="side A's EXL3 metrics exporter (`vllm-exl3 metrics`), where its kernel backends and GPU "
                        "are reported (default: A's host, port 9469; absent: reported as unknown)")
    p.add_argument("--b-exporter", metavar="URL", default=None, help="the same for side B")
    p.add_argument("--a-label", default=None, help="a name for side A in the report (default A)")
    p.add_argument("--b-label", default=None, help="a name for side B in the report (default B)")
    p.add_argument("--concurrency", type=worker_counts, default=DEFAULT_CONCURRENCY,
                   help=f"concurrent requests per phase, comma-separated (default "
                        f"{','.join(map(str, DEFAULT_CONCURRENCY))})")
    p.add_argument("--categories", help="comma-separated subset of the prompt categories (default all eight)")
    p.add_argument("--prompts", type=int, metavar="N", help="the first N prompts of each category (default all)")
    p.add_argument("--max-tokens", type=int, metavar="N",
                   help="output tokens per request for every category (default: each category's own length)")
    p.add_argument("--api", choices=("chat", "completions"), default="chat",
                   help="/v1/chat/completions (default; the server needs a chat template) or /v1/completions")
    p.add_argument("--seed", type=int, default=0, help="sampling seed sent with every request (temperature is 0)")
    p.add_argument("--no-ignore-eos", dest="ignore_eos", action="store_false",
                   help="let a request end at the model's end-of-text (default: exactly the asked length on vLLM)")
    p.add_argument("--warmup", type=int, default=2, metavar="N", help="unmeasured requests per side first (default 2)")
    p.add_argument("--fill", type=int, default=1, metavar="N",
                   help="each concurrency phase sends at least N x its concurrency requests, the prompts repeated in "
                        "order, so a high level stays busy (default 1)")
    p.add_argument("--prefill", type=worker_counts, default=[], metavar="TOKENS",
                   help="a prefill phase after the others: prompts of these lengths in tokens (comma-separated, e.g. "
                        "2048,8192), one at a time, sent as token ids to /v1/completions")
    p.add_argument("--prefill-requests", type=int, default=3, metavar="N",
                   help="prompts per prefill length (default 3)")
    p.add_argument("--api-key", default=os.environ.get("VLLM_API_KEY") or None,
                   help="the server's API key (default: $VLLM_API_KEY, as the appliance's .env sets it)")
    p.add_argument("--request-timeout", type=_seconds, default=600.0, metavar="S", help="seconds per request")
    p.add_argument("--idle-timeout", type=_seconds, default=120.0, metavar="S",
                   help="seconds to wait for a server to finish others' requests before a phase")
    p.add_argument("-o", "--out", metavar="DIR", help="output folder (default ./bench-<UTC time>)")
    p.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    p.add_argument("--report", metavar="RESULTS_JSON",
                   help=f"re-render the report and plots of a saved run ({RESULTS}) without sending requests")


def _render(report: dict, out: Path, plots: bool, console, err_console) -> list[Path]:
    from ..servebench import report as rep

    written = [out / REPORT]
    (out / REPORT).write_text(rep.markdown(report))
    if plots:
        from ..servebench import plots as plot

        try:
            written += [p for p in (plot.categories_png(report, out / CATEGORIES_PNG),
                                    plot.concurrency_png(report, out / CONCURRENCY_PNG)) if p]
        except ImportError as e:  # matplotlib is in the bench and test extras, not in a plain install
            err_console.print(f"no plots ({e.name or 'matplotlib'} is not installed: pip install "
                              "'vllm-exl3[bench]', or --no-plots); the report and the raw JSON are written",
                              highlight=False)
    console.print(rep.markdown(report), highlight=False, markup=False, soft_wrap=True)
    return written


def _workload(a: argparse.Namespace, specs: dict[str, str], saved: dict[str, dict], err_console):
    """The options' workload, or the saved sides' (both sides must send the same requests)."""
    from ..servebench.saved import common_workload
    from ..servebench.workload import build_workload

    if not saved:
        return build_workload(a.categories.split(",") if a.categories else None, a.prompts, a.max_tokens,
                              sorted(set(a.concurrency)), a.api, a.seed, a.ignore_eos, a.warmup, a.fill, a.prefill,
                              a.prefill_requests)
    workload = common_workload({specs[name]: run for name, run in saved.items()})
    err_console.print(f"workload: the saved run's ({', '.join(specs[n] for n in saved)}): "
                      f"{len(workload.prompts)} prompts, concurrency {','.join(map(str, workload.concurrency))}; "
                      "the workload options are not used", highlight=False)
    return workload


def run(a: argparse.Namespace) -> int:
    from ..servebench import runner
    from ..servebench import saved as saved_runs

    if a.report:
        try:
            report = saved_runs.load_run(a.report)
        except saved_runs.SavedRunError as e:
            raise UsageError(f"--report {e}") from e
        out = Path(a.out) if a.out else Path(a.report).parent
        out.mkdir(parents=True, exist_ok=True)
        for path in _render(report, out, not a.no_plots, console, err_console):
            err_console.print(f"wrote {path}", highlight=False)
        return 0
    if not a.a:
        raise UsageError("give the endpoint to measure: --a URL (and --b URL for a head-to-head), "
                         "or --report RESULTS_JSON to re-render a saved run", 2)
    if a.b and a.b.rstrip("/") == a.a.rstrip("/"):
        raise UsageError(f"--a and --b are the same ({a.a}); a head-to-head needs two servers (or a saved run of "
                         "one and the server of the other)", 2)
    specs = {"A": a.a, **({"B": a.b} if a.b else {})}
    try:
        saved = {name: saved_runs.load_run(spec) for name, spec in specs.items() if not _is_url(spec)}
        for name, run_ in saved.items():
            saved_runs.one_side(run_, specs[name])  # refuse before measuring the other side
        workload = _workload(a, specs, saved, err_console)
    except ValueError as e:  # WorkloadError, SavedRunError
        raise UsageError(str(e), 2) from e
    out = Path(a.out or f"bench-{datetime.datetime.now(datetime.timezone.utc):%Y%m%d-%H%M%S}")
    try:
        out.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UsageError(f"-o {out}: cannot create the output folder: {e.strerror}") from e
    urls = {name: spec for name, spec in specs.items() if name not in saved}
    labels = {"A": a.a_label, "B": a.b_label}
    opts = runner.Options(request_timeout_s=a.request_timeout, idle_timeout_s=a.idle_timeout, api_key=a.api_key)

    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    prog = Progress(TextColumn("{task.description:<16}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                    console=err_console, disable=not err_console.is_terminal or not urls)
    task = prog.add_task("bench", total=runner.total_requests(len(urls), workload))
    with prog:
        report = runner.run(urls, labels, workload, opts,
                            progress=lambda what, n: prog.update(task, description=what, advance=n),
                            exporters={"A": a.a_exporter, "B": a.b_exporter}) \
            if urls else runner.new_report(workload)
    for name, run_ in saved.items():
        saved_runs.merge(report, name, run_, specs[name], labels[name])
    (out / RESULTS).write_text(saved_runs.dumps(report))
    written = [out / RESULTS, *_render(report, out, not a.no_plots, console, err_console)]
    for path in written:
        err_console.print(f"wrote {path}", highlight=False)
    if report["partial"]:
        err_console.print(f"[red]error:[/] {report['error']}", highlight=False, soft_wrap=True)
        err_console.print(f"the report in {out} is PARTIAL: it holds only what was measured before the stop",
                          highlight=False)
        return EXIT_PARTIAL
    return 0


def bench(p: argparse.ArgumentParser):
    """Serving benchmark of an OpenAI-compatible endpoint, or two head to head (--a URL --b URL): eight prompt
    categories, streaming, TTFT, decode tok/s, ITL, E2E per concurrency level, with the server's own /metrics beside
    the client's numbers; writes raw JSON, a Markdown report and PNG plots (docs/bench.md)."""
    add_arguments(p)
    return run
