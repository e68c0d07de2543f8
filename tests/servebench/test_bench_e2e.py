"""`vllm-exl3 bench` against real vLLM (CPU build) demo servers on loopback: one endpoint, a head-to-head of two,
and the ways a run goes wrong (a closed port, a refusal, a server stopped mid-run). Two servers, booted once for the
module side by side; each run is small (one prompt per category, a few tokens, concurrency 1 and 2). A server
without a chat template: tests/e2e/test_two_servers_e2e.py (its servers have none; these have one)."""

from __future__ import annotations

import json
import math
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import requests
from support.servers import free_port, vllm_servers
from vllm_exl3 import demo
from vllm_exl3.servebench import server_metrics

pytestmark = pytest.mark.e2e

TOKENS = 8
SMALL = ("--prompts", "1", "--max-tokens", str(TOKENS), "--concurrency", "1,2", "--warmup", "1")
PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    with vllm_servers(2, demo.PACK, tmp_path_factory.mktemp("bench-servers"), "--chat-template",
                      str(demo.CHAT_TEMPLATE)) as pair:
        yield pair


def bench_argv(*args: str) -> list[str]:
    script = Path(sys.executable).parent / "vllm-exl3"
    exe = str(script) if script.exists() else shutil.which("vllm-exl3") or pytest.skip("no vllm-exl3 script")
    return [exe, "bench", *args]


def bench(*args: str, timeout: float = 180) -> subprocess.CompletedProcess:
    r = subprocess.run(bench_argv(*args), check=False, capture_output=True, text=True, timeout=timeout, env=dict(os.environ))
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    return r


def finite(x) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


def check_sane(results: dict, sides: list[str], levels: list[int]) -> None:
    """Every request streamed exactly the asked tokens with sane times, and each server counted what we received."""
    assert not results["partial"] and results["error"] is None
    assert [(p["side"], p["concurrency"]) for p in results["phases"]] == [(s, c) for c in levels for s in sides]
    for phase in results["phases"]:
        reqs = phase["requests"]
        assert len(reqs) == 8 and all(r["ok"] for r in reqs)
        for r in reqs:
            assert r["tokens"] == TOKENS and r["token_counts"] == "usage" and r["finish_reason"] == "length"
            assert finite(r["ttft_s"]) and finite(r["e2e_s"]) and 0 < r["ttft_s"] < r["e2e_s"]
            times = [t for t, _ in r["chunks"]]
            counts = [n for _, n in r["chunks"]]
            assert times == sorted(times) and counts == sorted(counts) and counts[-1] == TOKENS
        server = phase["server"]
        assert server["generation_tokens"] == sum(r["tokens"] for r in reqs) == 8 * TOKENS
        assert server["requests"] == 8
        assert all(finite(server[k]) and server[k] > 0 for k in ("ms_per_step", "tokens_per_s", "ttft_ms"))
        assert server["tokens_per_step"] == 1  # no speculative decoding: one token per decode step
        if phase["concurrency"] == 1:  # one request at a time: the server's account of each category too
            by_category = phase["server_by_category"]
            assert list(by_category) == results["workload"]["categories"]
            assert all(c["generation_tokens"] == TOKENS and finite(c["ms_per_step"]) for c in by_category.values())
        else:
            assert phase["server_by_category"] is None
        s = phase["summary"]
        assert all(finite(s[k]) and s[k] > 0 for k in ("decode_tok_s", "aggregate_tok_s", "ttft_ms", "e2e_ms"))
        assert s["ttft_ms"] < s["e2e_ms"]


def check_pngs(out: Path) -> None:
    import matplotlib.image

    for name in ("categories.png", "concurrency.png"):
        path = out / name
        assert path.read_bytes()[:8] == PNG_MAGIC
        height, width = matplotlib.image.imread(path).shape[:2]
        assert width > 600 and height > 300


def expected_backends(server) -> object:
    """What the report must say: the plugin's backend gauge when the server exports it, else "not reported"."""
    snap = server_metrics.parse(requests.get(f"{server.base_url}/metrics", timeout=10).text)
    return snap.backends or "not reported"


@pytest.fixture(scope="module")
def one_run(servers, tmp_path_factory):
    out = tmp_path_factory.mktemp("one-endpoint")
    return bench("--a", servers[0].base_url, *SMALL, "-o", str(out)), out


def test_one_endpoint(servers, one_run):
    server = servers[0]
    r, out = one_run
    assert r.returncode == 0, r.stderr
    results = json.loads((out / "results.json").read_text())
    check_sane(results, ["A"], [1, 2])
    side = results["sides"]["A"]
    assert side["model"] == server.model and side["vllm_metrics"] and side["gpu"] == "unknown"
    assert side["backends"] == expected_backends(server)
    report = (out / "report.md").read_text()
    assert "| category | tok/s | TTFT ms | ITL p50 ms | ITL p99 ms | E2E ms |" in report
    assert all(f"| {c} |" in report for c in results["workload"]["categories"])
    assert f"model `{server.model}`" in report and "PARTIAL" not in report
    assert r.stdout.rstrip().splitlines()[-1].startswith("bench at concurrency 1, all categories: A ")
    check_pngs(out)


def test_saved_run_stands_in_for_side_a(servers, one_run, tmp_path):
    """One Spark: side A measured earlier (then the profile switched), side B now, with A's workload."""
    saved = one_run[1] / "results.json"
    r = bench("--a", str(saved), "--b", servers[1].base_url, "--b-label", "later", "--max-tokens", "99",
              "-o", str(tmp_path))
    assert r.returncode == 0, r.stderr
    assert "the workload options are not used" in r.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["sides"]["A"]["saved_from"] == str(saved) and results["sides"]["B"]["label"] == "later"
    assert [(p["side"], p["concurrency"]) for p in results["phases"]] == [("B", 1), ("B", 2), ("A", 1), ("A", 2)]
    assert all(r["tokens"] == TOKENS for p in results["phases"] for r in p["requests"])  # A's 8, not 99
    assert "| category | A tok/s | B tok/s |" in (tmp_path / "report.md").read_text()


def test_head_to_head(servers, tmp_path):
    a, b = servers
    r = bench("--a", a.base_url, "--b", b.base_url, "--a-label", "first", "--b-label", "second",
              "--api", "completions", *SMALL, "-o", str(tmp_path))
    assert r.returncode == 0, r.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    check_sane(results, ["A", "B"], [1, 2])
    assert results["sides"]["B"]["url"] == b.base_url and results["sides"]["B"]["label"] == "second"
    report = (tmp_path / "report.md").read_text()
    header = ("| category | A tok/s | B tok/s | A TTFT ms | B TTFT ms | speedup (B/A) | A server ms/step | "
              "B server ms/step | server speedup (B/A) |")
    assert header in report
    rows = [line for line in report.splitlines() if line.startswith("| ") and line.endswith("× |")]
    assert len(rows) == 9  # eight categories and all of them together
    for row in rows:
        cells = [c.strip() for c in row.strip("|").split("|")]
        assert all(finite(float(x.rstrip("×").replace(",", ""))) for x in cells[1:]), row
    assert "B/A decode speedup" in r.stdout and "(client " in r.stdout and "A server " in r.stdout
    check_pngs(tmp_path)
    # the saved run renders again, to the same table
    again = bench("--report", str(tmp_path / "results.json"), "-o", str(tmp_path / "again"), "--no-plots")
    assert again.returncode == 0 and header in (tmp_path / "again" / "report.md").read_text()


def test_closed_port_gives_one_message_and_a_partial_report(tmp_path):
    url = f"http://127.0.0.1:{free_port()}"
    r = bench("--a", url, *SMALL, "-o", str(tmp_path))
    assert r.returncode == 3
    errors = [line for line in r.stderr.splitlines() if line.startswith("error:")]
    assert errors == [(f"error: cannot connect to {url}/v1/models: connection refused (is the server running, and "
                       "is this its address?)")], r.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["partial"] and results["phases"] == [] and not results["sides"]["A"]["reached"]
    assert "**PARTIAL REPORT: the run stopped early: cannot connect" in (tmp_path / "report.md").read_text()


def test_refused_requests_are_reported_with_the_servers_reason(servers, tmp_path):
    # 300 output tokens do not fit the demo servers' --max-model-len 256: vLLM answers HTTP 400
    r = bench("--a", servers[0].base_url, "--prompts", "1", "--max-tokens", "300", "--concurrency", "1",
              "-o", str(tmp_path))
    assert r.returncode == 3
    error = next(line for line in r.stderr.splitlines() if line.startswith("error:"))
    assert "A warm-up failed: HTTP 400 from" in error and "max" in error, r.stderr
    assert json.loads((tmp_path / "results.json").read_text())["partial"]


def test_fill_and_the_prefill_phase(servers, tmp_path):
    """--fill keeps a level busy (2 prompts at concurrency 4 become 8 requests); --prefill measures long prompts
    sent as token ids, and the server's prefill rate comes from its own counters. Each prefill length is preceded
    by one unmeasured prompt of that length: the server counts it, the phase does not."""
    def prompt_tokens_served() -> float:
        text = requests.get(f"{servers[0].base_url}/metrics", timeout=10).text
        return server_metrics.parse(text).values.get(server_metrics.PROMPT_TOKENS, 0)

    before = prompt_tokens_served()
    r = bench("--a", servers[0].base_url, "--categories", "coding,prose", "--prompts", "1", "--max-tokens", "8",
              "--concurrency", "1,4", "--fill", "2", "--prefill", "64,128", "--prefill-requests", "2",
              "--warmup", "1", "--api", "completions", "--no-plots", "-o", str(tmp_path))
    assert r.returncode == 0, r.stderr
    results = json.loads((tmp_path / "results.json").read_text())
    measured = sum(q["prompt_tokens"] for p in results["phases"] for q in p["requests"])
    general_warmup = next(q["prompt_tokens"] for p in results["phases"] for q in p["requests"]
                          if q["category"] == "coding")  # --warmup 1 sends the first prompt (coding) once
    assert prompt_tokens_served() - before == measured + general_warmup + 64 + 128
    by_level = {p["concurrency"]: p for p in results["phases"] if "prefill_length" not in p}
    assert len(by_level[1]["requests"]) == 2 and len(by_level[4]["requests"]) == 8
    prefill = [p for p in results["phases"] if "prefill_length" in p]
    assert [(p["prefill_length"], len(p["requests"])) for p in prefill] == [(64, 2), (128, 2)]
    for p in prefill:
        assert all(q["ok"] and q["prompt_tokens"] == p["prefill_length"] for q in p["requests"])
        assert p["server"]["prompt_tokens"] == 2 * p["prefill_length"] and p["server"]["prefill_tokens_per_s"] > 0
    report = (tmp_path / "report.md").read_text()
    assert "| side | prompt tokens | requests | server prefill tok/s |" in report and "| A | 128 | 2/2 |" in report
    assert "A server " in r.stdout.rstrip().splitlines()[-1]  # the headline leads with the server's counters


def test_server_stopped_mid_run_leaves_a_partial_report(servers, tmp_path):
    """Runs last: it kills the second server."""
    server = servers[1]

    def finished() -> float:
        snap = server_metrics.parse(requests.get(f"{server.base_url}/metrics", timeout=10).text)
        return snap.values.get(f"{server_metrics.E2E_LATENCY}_count", 0)

    earlier = finished()
    # --fill 500: a run of 500 requests (minutes), so the stop lands inside it however late this loop sees the
    # server's count move on a loaded machine (24 requests, ~10 s, once finished before the kill on CI)
    proc = subprocess.Popen(bench_argv("--a", server.base_url, "--max-tokens", "200", "--concurrency", "1",
                                       "--fill", "500", "--warmup", "1", "--request-timeout", "60",
                                       "-o", str(tmp_path)),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=dict(os.environ))
    try:
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline:  # until measured requests are finishing (the warm-up is one)
            if finished() >= earlier + 3:
                break
            time.sleep(0.2)
        os.killpg(server.proc.pid, signal.SIGKILL)  # a crash: no draining of running requests, no wait
        server.proc.wait()
        out, err = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
    assert proc.returncode == 3 and "Traceback" not in out + err, err
    assert [line for line in err.splitlines() if line.startswith("error:")], err
    results = json.loads((tmp_path / "results.json").read_text())
    assert results["partial"] and server.base_url in results["error"], results["error"]
    # the stop shows in a request that breaks, or (vLLM lets running requests finish) in the next scrape
    (phase,) = results["phases"]
    assert phase.get("incomplete") and sum(r["ok"] for r in phase["requests"]) >= 2, results["error"]
    assert "PARTIAL REPORT" in (tmp_path / "report.md").read_text()
