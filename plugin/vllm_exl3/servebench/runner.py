"""A run: probe each endpoint (model, vLLM metrics, backends, GPU), warm it up, then for each concurrency level and
each side one measured phase: wait until the server is idle, scrape `/metrics`, send every prompt (at most
`concurrency` in flight), wait until idle again, scrape again. The phases alternate between the sides at each level,
so a drift of the client or the network touches both. Any failure ends the run with what was measured so far,
marked partial; nothing here raises for what a server does."""

from __future__ import annotations

import asyncio
import datetime
import json
import platform
import time
import urllib.parse
from collections.abc import Callable
from dataclasses import dataclass, field
from importlib import metadata

import aiohttp

from . import client, server_metrics, stats
from .client import EndpointError
from .workload import Workload

# Seconds to wait for a side's EXL3 exporter, which is optional.
EXPORTER_TIMEOUT_S = 3.0
# Seconds between two `/metrics` scrapes while waiting for the server to become idle.
IDLE_POLL_S = 0.2
UNKNOWN = "unknown"
NOT_REPORTED = "not reported"


@dataclass
class Side:
    """One endpoint under test, with what it said about itself."""

    name: str  # "A" or "B"
    url: str
    label: str
    reached: bool = False  # /v1/models answered with a model
    model: str = UNKNOWN
    max_model_len: int | None = None
    vllm_metrics: bool = False
    backends: dict[str, list[str]] = field(default_factory=dict)
    gpu: str = UNKNOWN
    exporter: str | None = None  # the node's EXL3 exporter, where the backends and the GPU are reported

    def to_json(self) -> dict:
        d = dict(self.__dict__)
        d["backends"] = self.backends or NOT_REPORTED
        return d


@dataclass
class Options:
    request_timeout_s: float = 600.0
    idle_timeout_s: float = 120.0
    scrape_timeout_s: float = 10.0
    api_key: str | None = None  # sent as a bearer token (vLLM's --api-key guards /v1, not /metrics)


class RunStopped(Exception):
    """The run cannot go on (the message says why); what was measured so far is kept."""


ProgressFn = Callable[[str, int], None]  # (what is running now, requests finished since the last call)


async def _scrape(session: aiohttp.ClientSession, side: Side, opts: Options) -> server_metrics.Snapshot | None:
    status, text = await client.get(session, side.url + "/metrics", opts.scrape_timeout_s)
    if status != 200:
        return None
    try:
        return server_metrics.parse(text)
    except server_metrics.MetricsFormatError:
        return None


async def probe(session: aiohttp.ClientSession, side: Side, opts: Options) -> None:
    """Fill in the model (from /v1/models, which must answer), and what /metrics says when it exists."""
    url = side.url + "/v1/models"
    status, text = await client.get(session, url, opts.scrape_timeout_s)
    if status == 401:
        raise EndpointError(f"{url} answered HTTP 401: the server wants an API key ("
                            + ("the one given was refused)" if opts.api_key else "give it with --api-key or "
                               "VLLM_API_KEY)"))
    if status != 200:
        raise EndpointError(f"{url} answered HTTP {status}: {client.error_text(text.encode())} "
                            "(an OpenAI-compatible server lists its models there)")
    try:
        models = json.loads(text)["data"]
        side.model = models[0]["id"]
        side.max_model_len = models[0].get("max_model_len")
    except (ValueError, KeyError, IndexError, TypeError) as e:
        raise EndpointError(f"{url} does not list a model (expected {{\"data\": [{{\"id\": ...}}]}})") from e
    side.reached = True
    snap = await _scrape(session, side, opts)
    if snap is not None:
        side.vllm_metrics = snap.is_vllm
        side.backends = snap.backends
        side.gpu = snap.gpu or UNKNOWN
    if side.exporter and (not side.backends or side.gpu == UNKNOWN):
        # Optional: an exporter that is not there (not started, bound to loopback on the Spark) leaves
        # "not reported" / "unknown" in the report, never an error.
        try:
            status, text = await client.get(session, side.exporter.rstrip("/") + "/metrics", EXPORTER_TIMEOUT_S)
            extra = server_metrics.parse(text) if status == 200 else None
        except (EndpointError, server_metrics.MetricsFormatError):
            extra = None
        if extra is not None:
            side.backends = side.backends or extra.backends
            side.gpu = side.gpu if side.gpu != UNKNOWN else extra.gpu or UNKNOWN


async def _wait_idle(session: aiohttp.ClientSession, side: Side, opts: Options) -> server_metrics.Snapshot | None:
    """The first scrape that shows nothing running or waiting (None for a server without vLLM's metrics)."""
    if not side.vllm_metrics:
        return None
    deadline = time.monotonic() + opts.idle_timeout_s
    while True:
        snap = await _scrape(session, side, opts)
        if snap is None:
            raise RunStopped(f"{side.name} ({side.url}): /metrics stopped answering")
        if snap.idle:
            return snap
        if time.monotonic() > deadline:
            raise RunStopped(f"{side.name} ({side.url}) is busy: {snap.running:g} request(s) running and "
                             f"{snap.waiting:g} waiting after {opts.idle_timeout_s:g} s; another client is using "
                             "it, so its numbers would not be ours")
        await asyncio.sleep(IDLE_POLL_S)


async def _send_all(session: aiohttp.ClientSession, side: Side, workload: Workload, prompts, concurrency: int,
                    progress: ProgressFn, t0: float | None = None) -> tuple[list[client.RequestResult], float]:
    """Every prompt, at most `concurrency` in flight: the results and the wall time (request times from `t0`)."""
    gate = asyncio.Semaphore(concurrency)
    start = time.perf_counter()

    async def one(p):
        async with gate:
            r = await client.stream(session, side.url, workload, p, side.model, side.vllm_metrics,
                                    start if t0 is None else t0)
        progress(f"{side.name} c={concurrency}", 1)
        return r

    results = await asyncio.gather(*(one(p) for p in prompts))
    return list(results), time.perf_counter() - start


async def warm_up(session: aiohttp.ClientSession, side: Side, workload: Workload, progress: ProgressFn) -> None:
    """`workload.warmup` requests (the first prompts, all at once), not measured; one failure stops the run."""
    if workload.warmup < 1:
        return
    prompts = (workload.prompts * workload.warmup)[: workload.warmup]
    results, _ = await _send_all(session, side, workload, prompts, workload.warmup, progress)
    bad = next((r for r in results if not r.ok), None)
    if bad:
        raise RunStopped(f"{side.name} warm-up failed: {bad.error}")


def _windows(workload: Workload, concurrency: int, side: Side) -> list[tuple[str | None, list]]:
    """The prompts of a phase in measurement windows. One request at a time, each category is its own window
    between two scrapes, so the server's ms/step is known per category too; with more in flight the categories
    mix, as they would in service, and the phase is one window."""
    if concurrency > 1 or not side.vllm_metrics:
        return [(None, workload.phase_prompts(concurrency))]
    return [(c, [p for p in workload.prompts if p.category == c]) for c in workload.categories]


async def measure(session: aiohttp.ClientSession, side: Side, workload: Workload, concurrency: int,
                  opts: Options, progress: ProgressFn, prefill_length: int | None = None) -> dict:
    """One phase: its requests, the client's summary, the server's account of the whole phase and, one request at
    a time, of each category. The wall time counts only the windows, not the scrapes between them. With
    `prefill_length`, the prefill phase of that prompt length instead (one request at a time, one window)."""
    t0 = time.perf_counter()
    results: list[client.RequestResult] = []
    wall = 0.0
    first = last = None
    by_category = {}
    phase = {"side": side.name, "concurrency": concurrency, "wall_s": 0.0, "requests": [], "summary": None,
             "server": None, "server_by_category": None}
    windows = _windows(workload, concurrency, side)
    if prefill_length is not None:
        phase["prefill_length"] = prefill_length
        windows = [(None, workload.prefill_phase(prefill_length))]
        if workload.warmup > 0:
            warm, _ = await _send_all(session, side, workload, [workload.prefill_warmup(prefill_length)], 1, progress)
            if not warm[0].ok:
                raise RunStopped(f"{side.name} prefill warm-up ({prefill_length} tokens) failed: {warm[0].error}")
    try:
        for category, window in windows:
            before = await _wait_idle(session, side, opts)
            got, seconds = await _send_all(session, side, workload, window, concurrency, progress, t0)
            results += got
            wall += seconds
            phase["requests"] = [r.to_json() for r in results]
            phase["wall_s"] = wall
            phase["summary"] = stats.summarize(phase["requests"], wall)
            failed = next((r for r in got if not r.ok), None)
            if failed:
                raise RunStopped(f"{side.name}: {failed.error}")
            after = await _wait_idle(session, side, opts)
            first = first or before
            last = after
            if category and before is not None and after is not None:
                server = server_metrics.difference(before, after, seconds)
                by_category[category] = server.to_json() if server else None
    except (RunStopped, EndpointError) as e:
        if not phase["requests"]:
            raise
        # keep what this phase measured: its requests, and the categories the server accounted for
        phase["incomplete"] = True
        phase["server_by_category"] = by_category or None
        raise _PhaseFailed(phase, str(e)) from e
    if first is not None and last is not None:
        server = server_metrics.difference(first, last, wall)
        phase["server"] = server.to_json() if server else None
    phase["server_by_category"] = by_category or None
    return phase


class _PhaseFailed(RunStopped):
    def __init__(self, phase: dict, message: str):
        super().__init__(message)
        self.phase = phase


async def _run(sides: list[Side], workload: Workload, opts: Options, progress: ProgressFn, report: dict) -> None:
    timeout = aiohttp.ClientTimeout(total=opts.request_timeout_s, sock_connect=opts.scrape_timeout_s)
    connector = aiohttp.TCPConnector(limit=max(workload.concurrency + [workload.warmup, 1]) + 4)
    headers = {"Authorization": f"Bearer {opts.api_key}"} if opts.api_key else None
    async with aiohttp.ClientSession(timeout=timeout, connector=connector, headers=headers) as session:
        for side in sides:
            progress(f"{side.name}: probing", 0)
            await probe(session, side, opts)
        for side in sides:
            progress(f"{side.name}: warm-up", 0)
            await warm_up(session, side, workload, progress)
        levels = [(c, None) for c in workload.concurrency] + [(1, n) for n in workload.prefill_lengths]
        for c, prefill_length in levels:
            for side in sides:
                try:
                    report["phases"].append(await measure(session, side, workload, c, opts, progress,
                                                          prefill_length))
                except _PhaseFailed as e:
                    report["phases"].append(e.phase)
                    raise


def _version() -> str:
    try:
        return metadata.version("vllm-exl3")
    except metadata.PackageNotFoundError:  # a source tree on PYTHONPATH, not installed
        return "(not installed)"


def total_requests(sides: int, workload: Workload) -> int:
    return sides * (workload.warmup + sum(len(workload.phase_prompts(c)) for c in workload.concurrency)
                    + len(workload.prefill_prompts) + (len(workload.prefill_lengths) if workload.warmup > 0 else 0))


def new_report(workload: Workload) -> dict:
    """The raw report before any side is measured."""
    return {"tool": f"vllm-exl3 bench {_version()}", "started": datetime.datetime.now(datetime.timezone.utc)
            .isoformat(timespec="seconds"), "client": platform.node(), "workload": workload.to_json(),
            "sides": {}, "phases": [], "partial": False, "error": None}


def default_exporter(url: str) -> str:
    """Where a node's EXL3 exporter answers by default: the endpoint's host, the exporter's default port."""
    parts = urllib.parse.urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    return f"{parts.scheme or 'http'}://{'[' + host + ']' if ':' in host else host}:{server_metrics.EXPORTER_PORT}"


def run(urls: dict[str, str], labels: dict[str, str], workload: Workload, opts: Options | None = None,
        progress: ProgressFn | None = None, exporters: dict[str, str | None] | None = None) -> dict:
    """Run the workload against each endpoint (`urls`: side name -> base URL) and return the raw report: every
    request, every phase's summary and server-side numbers, the sides' identities, and `partial`/`error` when it
    stopped early. `exporters` (side name -> URL) says where each side's EXL3 exporter answers (default: the
    endpoint's host on the exporter's default port)."""
    opts = opts or Options()
    exporters = exporters or {}
    sides = [Side(name, url.rstrip("/").removesuffix("/v1"), labels.get(name) or name,
                  exporter=exporters.get(name) or default_exporter(url)) for name, url in urls.items()]
    report = new_report(workload)
    try:
        asyncio.run(_run(sides, workload, opts, progress or (lambda what, n: None), report))
    except (RunStopped, EndpointError) as e:
        report["partial"], report["error"] = True, str(e)
    except KeyboardInterrupt:
        report["partial"], report["error"] = True, "interrupted"
    report["sides"] = {s.name: s.to_json() for s in sides}
    return report
