"""Two demo servers on one machine, one started with vLLM's own `vllm serve` command (docs/bench.md recommends
`vllm bench serve`, docs/vllm-notes.md §2.4 says why the command needs scripts/bootstrap's alias), the other as
`python -m vllm.entrypoints.openai.api_server`: each keeps its own parity report, and `vllm-exl3 info` shows
both, or one server's with --port; the boot progress of `vllm-exl3 serve`, replayed over a real boot log, names
what vLLM is doing; `vllm-exl3 bench` against a server without a chat template (neither has one) says to use
completions."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import psutil
import pytest

from vllm_exl3 import demo
from vllm_exl3.cli.serve_report import boot_phase
from support.servers import cpu_env, server_argv, vllm_command, vllm_serve_argv, vllm_servers

pytestmark = pytest.mark.e2e

CONSOLE = str(Path(sys.executable).parent / "vllm-exl3")


@pytest.fixture(scope="module")
def servers(tmp_path_factory):
    if not vllm_command().exists():
        pytest.skip(f"no `vllm` command beside {sys.executable}")
    tmp = tmp_path_factory.mktemp("servers")
    env = cpu_env(TMPDIR=str(tmp))  # the parity reports of these servers only
    with vllm_servers(2, demo.PACK, tmp, env=env, argvs=[server_argv, vllm_serve_argv]) as pair:
        yield pair, env


def port(server) -> int:
    return int(server.base_url.rsplit(":", 1)[1])


def info(env, *args: str) -> subprocess.CompletedProcess:
    r = subprocess.run([CONSOLE, "info", *args], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and "Traceback" not in r.stderr, r.stderr
    return r


def test_vllms_own_command_serves_and_benchmarks(servers):
    (module_server, cli_server), env = servers
    version = subprocess.run([str(vllm_command()), "--version"], capture_output=True, text=True, timeout=300, env=env)
    assert version.returncode == 0 and version.stdout.strip().endswith("+cpu"), version.stderr[-2000:]
    # `vllm serve` booted (the fixture waited for /health); `vllm bench serve` measures it
    bench = subprocess.run([str(vllm_command()), "bench", "serve", "--base-url", cli_server.base_url, "--model",
                            str(demo.PACK), "--dataset-name", "random", "--random-input-len", "16",
                            "--random-output-len", "8", "--num-prompts", "4"],
                           capture_output=True, text=True, timeout=300, env=env)
    assert bench.returncode == 0, bench.stdout[-3000:] + bench.stderr[-3000:]
    assert "Successful requests:                     4" in bench.stdout, bench.stdout


def test_each_server_keeps_its_own_parity_report(servers):
    pair, env = servers
    reports = json.loads(info(env, "--json").stdout)["parity_reports"]
    by_server = {r["report"]["server"]: r for r in reports}
    assert sorted(by_server) == sorted(f"port-{port(s)}" for s in pair), reports
    for server in pair:
        r = by_server[f"port-{port(server)}"]
        writers = {p.pid for p in psutil.Process(server.proc.pid).children(recursive=True)}
        assert r["report"]["pid"] in writers and r["running"] is True, (r, writers)
        assert r["report"]["rank"] == 0 and r["report"]["served"], r
        # --port: that server's report only
        (one,) = json.loads(info(env, "--json", "--port", str(port(server))).stdout)["parity_reports"]
        assert one == r
    text = info(env).stdout
    for server in pair:
        assert f"parity gate of the server on port {port(server)}, rank 0" in text, text
    missing = info(env, "--port", "1").stdout
    assert "no report of a server on port 1 in" in missing, missing


def test_the_boot_progress_names_what_vllm_is_doing(servers):
    """`vllm-exl3 serve` names the boot phase from vLLM's log (cli/serve.py BOOT_PHASES), replayed here line by
    line over a real boot. After the plugin's pack line (the API server reading the pack's config) vLLM starts
    its engine and then its worker process, each importing vLLM again: most of a CPU boot, once shown as
    "reading the pack" for a 2.4 MiB pack. The pack is read in the weight-loading phase."""
    (server, _), _ = servers
    lines = server.log.read_text().splitlines()
    phases = [boot_phase("\n".join(lines[:i + 1])) for i in range(len(lines))]
    sequence = [p for i, p in enumerate(phases) if i == 0 or p != phases[i - 1]]
    assert sequence == ["starting vLLM", "starting vLLM's engine process", "starting vLLM's model worker",
                        "loading weights", "sizing the KV cache", "starting the HTTP server"], sequence
    pack_line = next(i for i, line in enumerate(lines) if "EXL3 pack" in line)
    first_engine_line = next(i for i, line in enumerate(lines) if "(EngineCore" in line)
    assert pack_line < first_engine_line and phases[first_engine_line - 1] == "starting vLLM's engine process"


def test_bench_chat_without_a_template_says_to_use_completions(servers, tmp_path):
    """`vllm-exl3 bench` (the chat API by default) against a server with no chat template. Here rather than in
    tests/servebench/test_bench_e2e.py, whose servers have one: this pair has none, which saves a server boot."""
    (_, cli_server), _ = servers
    r = subprocess.run([CONSOLE, "bench", "--a", cli_server.base_url, "--prompts", "1", "--max-tokens", "4",
                        "--concurrency", "1", "--no-plots", "-o", str(tmp_path / "out")], check=False,
                       capture_output=True, text=True, timeout=180, env=dict(os.environ))
    assert "Traceback" not in r.stdout + r.stderr, r.stderr
    assert r.returncode == 3
    error = next(line for line in r.stderr.splitlines() if line.startswith("error:"))
    assert "no chat template" in error and "--api completions" in error, r.stderr
