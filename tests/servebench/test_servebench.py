"""The bench's pieces without a server: the shipped workload, the /metrics reader, the statistics, and the CLI's
refusals of bad options (one line, no traceback). The served end to end is tests/servebench/test_bench_e2e.py."""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from vllm_exl3.servebench import saved, server_metrics, stats
from vllm_exl3.servebench.workload import CATEGORY_ORDER, WorkloadError, build_workload, load_categories

ROOT = Path(__file__).resolve().parents[2]


def test_the_eight_categories_ship_with_the_package():
    cats = load_categories()
    assert tuple(cats) == CATEGORY_ORDER
    for c in cats.values():
        assert c.max_tokens >= 64 and len(c.prompts) >= 3 and c.description
    pyproject = (ROOT / "pyproject.toml").read_text()
    assert '"servebench/categories/*.toml"' in pyproject  # package-data: a wheel carries them


def test_workload_selection_and_overrides():
    w = build_workload(["json", "coding"], 2, 16, [1, 4], "completions", seed=7)
    assert [(p.category, p.index, p.max_tokens) for p in w.prompts] == \
        [("json", 0, 16), ("json", 1, 16), ("coding", 0, 16), ("coding", 1, 16)]
    own = build_workload(["reasoning"], None, None, [1], "chat")
    assert {p.max_tokens for p in own.prompts} == {load_categories()["reasoning"].max_tokens}
    assert own.to_json()["prompts"][0]["category"] == "reasoning"


@pytest.mark.parametrize("kwargs, message", [
    ({"categories": ["poetry"]}, "unknown category poetry; the shipped ones are coding, prose"),
    ({"prompts_per_category": 0}, "--prompts must be at least 1"),
    ({"max_tokens": 1}, "--max-tokens must be at least 2"),
    ({"warmup": -1}, "--warmup must be 0 or more"),
])
def test_workload_refusals(kwargs, message):
    args = {"categories": None, "prompts_per_category": None, "max_tokens": None, "concurrency": [1],
            "api": "chat", **kwargs}
    with pytest.raises(WorkloadError, match=message.replace("-", r"\-")):
        build_workload(**args)


EXPOSITION = """\
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="m"} 0.0
vllm:num_requests_running{engine="1",model_name="m"} 1.0
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="m"} 0.0
# TYPE vllm:generation_tokens_total counter
vllm:generation_tokens_total{engine="0",model_name="m"} 100.0
vllm:generation_tokens_total{engine="1",model_name="m"} 20.0
# TYPE vllm:inter_token_latency_seconds histogram
vllm:inter_token_latency_seconds_count{engine="0",model_name="m"} 110.0
vllm:inter_token_latency_seconds_sum{engine="0",model_name="m"} 0.55
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_count{engine="0",model_name="m"} 10.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 0.2
# TYPE vllm_exl3_backend_info gauge
vllm_exl3_backend_info{backend="native",layer_type="linear:mcg:4b:cuda",rank="0"} 1.0
vllm_exl3_backend_info{backend="native",layer_type="linear:mcg:4b:cuda",rank="1"} 1.0
vllm_exl3_backend_info{backend="torch",layer_type="moe:mcg:4b:cuda",rank="0"} 1.0
vllm_exl3_backend_info{backend="exllamav3",layer_type="moe:mcg:4b:cuda",rank="0"} 0.0
"""


def test_metrics_snapshot_sums_engines_and_reads_the_backend_gauge():
    snap = server_metrics.parse(EXPOSITION)
    assert snap.is_vllm and not snap.idle and snap.running == 1
    assert snap.values[server_metrics.GENERATION_TOKENS] == 120
    assert snap.backends == {"linear:mcg:4b:cuda": ["native"], "moe:mcg:4b:cuda": ["torch"]}
    assert snap.gpu is None
    plain = server_metrics.parse("# TYPE up gauge\nup 1\n")
    assert not plain.is_vllm and plain.backends == {}


def test_metrics_difference_is_the_servers_account_of_a_phase():
    before = server_metrics.parse(EXPOSITION)
    after = server_metrics.parse(EXPOSITION.replace(" 100.0", " 150.0").replace(" 110.0", " 150.0")
                                 .replace(" 0.55", " 0.75").replace("seconds_count{engine=\"0\",model_name=\"m\"} 10.0",
                                                                    "seconds_count{engine=\"0\",model_name=\"m\"} 12.0"))
    d = server_metrics.difference(before, after, wall_s=2.0)
    assert d.generation_tokens == 50 and d.requests == 2
    assert d.ms_per_step == pytest.approx(1000 * 0.2 / 40)
    assert d.tokens_per_s == pytest.approx(25) and d.decode_tokens_per_s == pytest.approx(48 / 0.2)
    assert d.tokens_per_step == pytest.approx(48 / 40)
    assert server_metrics.difference(server_metrics.parse(""), after, 1.0) is None
    assert d.draft_acceptance is None  # no speculative decoding: vLLM exports no draft counters


def test_a_speculative_phase_reports_its_draft_acceptance():
    spec = ('# TYPE vllm:spec_decode_num_draft_tokens counter\n'
            'vllm:spec_decode_num_draft_tokens_total{engine="0",model_name="m"} 30.0\n'
            '# TYPE vllm:spec_decode_num_accepted_tokens counter\n'
            'vllm:spec_decode_num_accepted_tokens_total{engine="0",model_name="m"} 12.0\n')
    before = server_metrics.parse(EXPOSITION + spec)
    after = server_metrics.parse((EXPOSITION + spec).replace(" 100.0", " 150.0").replace(" 30.0", " 90.0")
                                 .replace(" 12.0", " 57.0"))
    d = server_metrics.difference(before, after, wall_s=2.0)
    assert d.draft_acceptance == pytest.approx(45 / 60)
    assert d.to_json()["draft_acceptance"] == pytest.approx(0.75)


def test_metrics_that_do_not_parse_are_refused():
    with pytest.raises(server_metrics.MetricsFormatError):
        server_metrics.parse("vllm:num_requests_running{engine=0 oops\n")


def request(chunks, ok=True):
    return {"ok": ok, "chunks": chunks, "tokens": chunks[-1][1] if chunks else 0,
            "ttft_s": chunks[0][0] if chunks else None, "e2e_s": chunks[-1][0] + 0.01 if chunks else None}


def test_decode_speed_is_tokens_after_the_first_over_time_after_it():
    # 1 token at 100 ms, then 2 tokens per step (speculative decoding) every 50 ms: 4 tokens in 100 ms
    r = request([(0.10, 1), (0.15, 3), (0.20, 5)])
    s = stats.summarize([r], wall_s=0.21)
    assert s["decode_tok_s"] == pytest.approx(40) and s["ttft_ms"] == pytest.approx(100)
    assert s["itl_ms_pct"]["p50"] == pytest.approx(50) and s["tokens"] == 5
    assert s["aggregate_tok_s"] == pytest.approx(5 / 0.21)


def test_a_burst_does_not_dominate_the_group_rate():
    steady = request([(0.1, 1), (1.1, 101)])  # 100 tok/s
    burst = request([(0.1, 1), (0.1001, 101)])  # all at once: 1,000,000 tok/s on its own
    s = stats.summarize([steady, burst, request([], ok=False)])
    assert s["decode_tok_s"] == pytest.approx(200 / 1.0001) and s["failed"] == 1 and s["requests"] == 3
    assert stats.speedup(100.0, 150.0) == 1.5 and stats.speedup(None, 1.0) is None
    assert all(v is None for v in stats.summarize([])["itl_ms_pct"].values())
    assert not math.isnan(s["ttft_ms"])


def cli(*args: str) -> subprocess.CompletedProcess:
    script = Path(sys.executable).parent / "vllm-exl3"
    exe = [str(script)] if script.exists() else [shutil.which("vllm-exl3") or pytest.skip("no vllm-exl3 script")]
    r = subprocess.run([*exe, "bench", *args], check=False, capture_output=True, text=True, timeout=120, env=dict(os.environ))
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    return r


@pytest.mark.parametrize("args, code, message", [
    ([], 2, "give the endpoint to measure: --a URL"),
    (["--a", "spark:8000"], 2, "is neither an http(s) URL of a server (e.g. http://spark:8000) nor a saved run's"),
    (["--a", "http://127.0.0.1:9", "--b", "http://127.0.0.1:9/"], 2, "--a and --b are the same"),
    (["--a", "http://127.0.0.1:9", "--categories", "coding,poetry"], 2, "unknown category poetry"),
    (["--a", "http://127.0.0.1:9", "--concurrency", "1,0"], 2, "not a comma-separated list of positive integers"),
    (["--a", "http://127.0.0.1:9", "--request-timeout", "0"], 2, "'0' is not a positive number of seconds"),
])
def test_cli_refuses_bad_options_in_one_line(args, code, message, tmp_path):
    r = cli(*args, "-o", str(tmp_path / "out"))
    assert r.returncode == code and message in " ".join(r.stderr.split()), r.stderr
    assert not (tmp_path / "out" / "results.json").exists()


def test_cli_refuses_a_file_that_is_not_a_saved_run(tmp_path):
    bad = tmp_path / "results.json"
    bad.write_text('{"not": "a run"}')
    r = cli("--report", str(bad))
    assert r.returncode == 1 and "not a saved run of `vllm-exl3 bench` (results.json): it has no sides" in r.stderr
    r = cli("--a", str(bad), "--b", "http://127.0.0.1:9", "-o", str(tmp_path / "out"))
    assert r.returncode == 2 and f"{bad}: not a saved run" in r.stderr
    bad.write_text("{")
    assert "not JSON" in cli("--report", str(bad)).stderr


def saved_run(side_names=("A",), partial=False, max_tokens=8) -> dict:
    w = build_workload(["json"], 1, max_tokens, [1], "chat").to_json()
    req = {**request([[0.1, 1], [0.2, 8]]), "category": "json", "index": 0, "max_tokens": max_tokens}
    return {"started": "2026-01-01T00:00:00+00:00", "workload": w, "partial": partial, "error": None,
            "sides": {n: {"name": n, "label": n, "url": f"http://{n}"} for n in side_names},
            "phases": [{"side": n, "concurrency": 1, "wall_s": 0.3, "requests": [req]} for n in side_names]}


def test_saved_runs_round_trip_and_stand_in_for_a_side(tmp_path):
    run = saved_run()
    path = tmp_path / "results.json"
    path.write_text(saved.dumps(run))
    assert saved.load_run(path) == run
    assert '"chunks": [[0.1, 1], [0.2, 8]]' in path.read_text()  # one line per request, not per chunk value
    assert saved.common_workload({"a.json": run, "b.json": saved_run()}).prompts[0].category == "json"
    report = {"sides": {"A": {"name": "A", "label": "A"}}, "phases": []}
    saved.merge(report, "B", run, path, None)
    assert list(report["sides"]) == ["A", "B"] and report["sides"]["B"]["label"] == "B"
    assert report["sides"]["B"]["saved_from"] == str(path) and report["phases"][0]["side"] == "B"


@pytest.mark.parametrize("run, message", [
    (saved_run(partial=True), "a partial run"),
    (saved_run(("A", "B")), "a head-to-head run of 2 sides"),
])
def test_a_saved_side_must_be_one_complete_endpoint(run, message):
    with pytest.raises(saved.SavedRunError, match=message):
        saved.one_side(run, "x.json")


def test_saved_runs_with_different_workloads_are_refused():
    with pytest.raises(saved.SavedRunError, match="measured with different workloads"):
        saved.common_workload({"a.json": saved_run(), "b.json": saved_run(max_tokens=9)})


def test_the_default_exporter_port_is_the_appliance_default():
    from vllm_exl3.base.settings import default
    from vllm_exl3.servebench import runner, server_metrics

    assert server_metrics.EXPORTER_PORT == int(default("VLLM_EXL3_METRICS_PORT"))
    assert runner.default_exporter("http://10.0.0.5:8000/v1") == "http://10.0.0.5:9469"
    assert runner.default_exporter("http://[::1]:8000") == "http://[::1]:9469"


def test_fill_repeats_the_prompts_to_keep_a_level_busy():
    w = build_workload(["coding", "prose"], 1, 8, [1, 4, 16], "completions", fill=2)
    assert [len(w.phase_prompts(c)) for c in (1, 4, 16)] == [2, 8, 32]
    assert [p.category for p in w.phase_prompts(4)] == ["coding", "prose"] * 4


def test_prefill_prompts_are_seeded_token_ids_with_no_shared_prefix():
    a = build_workload(["coding"], 1, 8, [1], "chat", seed=3, prefill_lengths=[512, 64], prefill_requests=3)
    b = build_workload(["coding"], 1, 8, [1], "chat", seed=3, prefill_lengths=[64, 512], prefill_requests=3)
    assert a.prefill_lengths == [64, 512] and a.to_json() == b.to_json()
    long = a.prefill_phase(512)
    assert [len(p.token_ids) for p in long] == [512] * 3
    assert len({tuple(p.token_ids[:4]) for p in long}) == 3  # distinct from the first tokens: no prefix-cache hit
    assert all(100 <= t < 1000 for p in long for t in p.token_ids)
    # the unmeasured warm-up of a length: that length, seeded, sharing no first tokens with the measured prompts
    warm = a.prefill_warmup(512)
    assert len(warm.token_ids) == 512 and warm.token_ids == b.prefill_warmup(512).token_ids
    assert tuple(warm.token_ids[:4]) not in {tuple(p.token_ids[:4]) for p in long}
    restored = saved.workload_of({"workload": a.to_json()}, "results.json")
    assert restored.to_json() == a.to_json()


def test_the_prefill_rate_is_the_servers_prompt_tokens_over_its_prefill_time():
    def snap(prompt, prefill_s):
        return server_metrics.parse(
            f"vllm:num_requests_running 0\nvllm:num_requests_waiting 0\nvllm:generation_tokens_total 0\n"
            f"vllm:prompt_tokens_total {prompt}\nvllm:request_prefill_time_seconds_sum {prefill_s}\n"
            f"vllm:request_prefill_time_seconds_count 1\n")

    phase = server_metrics.difference(snap(100, 1.0), snap(8292, 1.5), 2.0)
    assert phase.prompt_tokens == 8192 and phase.prefill_tokens_per_s == pytest.approx(16384)


def test_without_matplotlib_the_report_is_still_written(tmp_path):
    """A plain install has no matplotlib: the plots are skipped with a line saying how to get them, nothing else."""
    saved_run = Path(__file__).resolve().parents[2] / "bench" / "results" / "cpu-demo-servebench" / "results.json"
    code = ("import sys; sys.modules['matplotlib'] = None\n"
            "from vllm_exl3.cli import main\n"
            f"sys.exit(main(['bench', '--report', {str(saved_run)!r}, '-o', {str(tmp_path)!r}]))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "no plots (matplotlib is not installed" in r.stderr and "internal error" not in r.stderr
    assert (tmp_path / "report.md").is_file() and not list(tmp_path.glob("*.png"))
