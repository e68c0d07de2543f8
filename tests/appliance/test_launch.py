"""The launcher's mapping role + preset + environment -> `vllm serve` argv, checked directly and against the real
vLLM (CPU build) argument parser; the CLI's dry run and refusals."""

from __future__ import annotations

import json
import re
import subprocess
import sys

import pytest

from vllm_exl3 import demo
from vllm_exl3.appliance.launch import (EXIT_REFUSED, EXTRA_AFTER_DASHES, EXTRA_ENV, ROLES, TOPOLOGY_OPTIONS,
                                        LaunchError, apply_plan, available_presets, build_spec, check_options,
                                        exec_argv, load_preset, plan_request)
from vllm_exl3.appliance.vllm_options import VllmOptions

SPARK_PRESETS = ("spark-1x", "spark-2x-tp2", "long-context", "low-latency", "spec-ngram", "spec-mtp")
TWO_NODE_ENV = {"VLLM_EXL3_HEAD_ADDR": "192.168.100.10", "VLLM_EXL3_SERVED_NAME": "glm", "VLLM_EXL3_PORT": "8000",
                "VLLM_EXL3_HOST": "0.0.0.0", "VLLM_EXL3_MODEL": "/model", "VLLM_EXL3_PEER_SECRET": "s" * 32}


def parsed(spec) -> VllmOptions:
    """What vllm_options.read_options answers for this spec, from vLLM's own parser in this process (the child
    process it normally runs in is tested in test_vllm_options.py)."""
    from vllm_exl3.integration.vllm_cli import parse_serve_args

    answer = parse_serve_args(spec.model, spec.argv()[3:], spec.option_groups())
    return VllmOptions(answer["effective"], answer["given"], answer["flags"])


def preset_role_pairs():
    for name in SPARK_PRESETS:
        nodes = load_preset(name, {}).nodes
        for role in ROLES.values():
            if nodes in (None, role.nnodes):
                yield name, role.name


def pairs(argv: list[str]) -> dict[str, str | bool]:
    """`--flag value` / bare `--flag` -> dict (flags appear once in the launcher's output)."""
    out = {}
    for i, a in enumerate(argv):
        if a.startswith("--"):
            nxt = argv[i + 1] if i + 1 < len(argv) else None
            out[a[2:]] = nxt if nxt is not None and not nxt.startswith("--") else True
    return out


def test_presets_are_found_and_complete():
    assert set(SPARK_PRESETS) <= set(available_presets({}))
    for name in SPARK_PRESETS:
        p = load_preset(name, {})
        assert p.description
        assert p.vllm["long-prefill-token-threshold"] == 1024  # long prefills must not starve decode
        assert p.vllm["load-format"] == "exl3_parallel"  # no mmap of the model on unified memory
        assert p.vllm["max-num-batched-tokens"] >= p.vllm["max-num-seqs"]
        assert not {k.replace("-", "_") for k in p.vllm} & TOPOLOGY_OPTIONS
        assert 0 < p.memory.max_gpu_memory_utilization <= 0.9


def test_single_spark_command():
    spec = build_spec("single", load_preset("spark-1x", {}), TWO_NODE_ENV | {"VLLM_EXL3_HEAD_ADDR": ""})
    argv = spec.argv()
    assert argv[:3] == ["vllm", "serve", "/model"]
    f = pairs(argv)
    assert f["tensor-parallel-size"] == "1" and f["served-model-name"] == "glm" and f["port"] == "8000"
    assert f["long-prefill-token-threshold"] == "1024" and f["enable-chunked-prefill"] is True
    assert not {"nnodes", "node-rank", "master-addr", "headless", "distributed-executor-backend"} & set(f)


def test_head_and_worker_commands_agree_on_topology():
    preset = load_preset("spark-2x-tp2", {})
    head = pairs(build_spec("head", preset, TWO_NODE_ENV).argv())
    worker = pairs(build_spec("worker", preset, TWO_NODE_ENV).argv())
    for f in (head, worker):
        assert f["tensor-parallel-size"] == "2" and f["nnodes"] == "2" and f["master-addr"] == "192.168.100.10"
        assert f["master-port"] == "29501" and f["distributed-executor-backend"] == "mp"
    assert head["node-rank"] == "0" and "headless" not in head and head["served-model-name"] == "glm"
    assert worker["node-rank"] == "1" and worker["headless"] is True
    assert not {"served-model-name", "port", "host", "middleware"} & set(worker)  # no API server on the worker
    same = {k for k in head if k not in ("node-rank", "served-model-name", "port", "host", "middleware")}
    assert {k: head[k] for k in same} == {k: worker[k] for k in same}  # everything else identical


def test_environment_and_extra_arguments():
    env = TWO_NODE_ENV | {"VLLM_EXL3_MASTER_PORT": "31000",
                          "VLLM_EXL3_EXTRA_ARGS": "--max-model-len 32768 --disable-log-stats"}
    spec = build_spec("head", load_preset("low-latency", {}), env, ["--max-num-seqs", "2"])
    argv = spec.argv()
    assert argv[-5:] == ["--max-num-seqs", "2", "--max-model-len", "32768", "--disable-log-stats"]  # last: they win
    assert pairs(argv)["master-port"] == "31000"
    assert spec.sources == {EXTRA_AFTER_DASHES: ["--max-num-seqs", "2"],
                            EXTRA_ENV: ["--max-model-len", "32768", "--disable-log-stats"]}
    options = parsed(spec)
    assert options.set_by(*spec.sources) == {"max_num_seqs": 2, "max_model_len": 32768, "disable_log_stats": True}
    assert options.value("max_num_seqs") == 2 and options.value("max_model_len") == 32768


@pytest.mark.parametrize("role,preset,env,message", [
    ("head", "spark-2x-tp2", {}, "HEAD_ADDR"),
    ("head", "spark-2x-tp2", {"VLLM_EXL3_HEAD_ADDR": "10.0.0.1"}, "VLLM_EXL3_PEER_SECRET is not set"),
    ("worker", "spark-2x-tp2", TWO_NODE_ENV | {"VLLM_EXL3_PEER_SECRET": "short"}, "5 characters, fewer than 16"),
    ("single", "spark-2x-tp2", {}, "--role head/worker"),
    ("worker", "spark-1x", TWO_NODE_ENV, "--role single"),
    ("single", "spark-1x", {"VLLM_EXL3_EXTRA_ARGS": "--served-model-name 'x"}, "not valid shell words"),
    ("leader", "spark-1x", {}, "unknown role"),
])
def test_impossible_launches_say_what_to_change(role, preset, env, message):
    with pytest.raises(LaunchError, match=message.replace("/", ".")):
        build_spec(role, load_preset(preset, {}), env)


# Spellings vLLM's parser takes for a topology option that a check by name let through: prefixes, short forms,
# underscores, `=`, a --config file.
TOPOLOGY_SPELLINGS = [["--tensor-parallel-size", "2"], ["-tp", "2"], ["--tensor-parallel", "2"],
                      ["--tensor_parallel_size=2"], ["-tp=2"], ["--headless"], ["--head"], ["-n", "2"],
                      ["--node-r", "1"], ["--master-ad", "10.0.0.9"], ["--distributed-executor-backend", "ray"],
                      ["--config", "{config}"]]


@pytest.mark.parametrize("where", ["extra", "env"])
@pytest.mark.parametrize("spelling", TOPOLOGY_SPELLINGS, ids=" ".join)
def test_topology_is_the_roles_in_every_spelling_vllm_reads(tmp_path, where, spelling):
    config = tmp_path / "vllm.yaml"
    config.write_text("tensor-parallel-size: 2\n")
    args = [a.replace("{config}", str(config)) for a in spelling]
    env = {"VLLM_EXL3_EXTRA_ARGS": " ".join(args)} if where == "env" else {}
    spec = build_spec("single", load_preset("spark-1x", {}), env, args if where == "extra" else [])
    source = EXTRA_ENV if where == "env" else EXTRA_AFTER_DASHES
    with pytest.raises(LaunchError, match=f"{re.escape(source)} set.*the topology comes from --role"):
        check_options(spec, parsed(spec))


@pytest.mark.parametrize("key", ["tensor-parallel-size", "tensor-parallel", "tensor_parallel_size", "node-r"])
def test_a_preset_cannot_set_the_topology(tmp_path, key):
    path = tmp_path / "mine.toml"
    path.write_text(f'[vllm]\n{key} = 1\n')
    spec = build_spec("single", load_preset(str(path), {}), {})
    with pytest.raises(LaunchError, match=f"preset mine .*{re.escape(str(path))}.* set.*the topology comes from"):
        check_options(spec, parsed(spec))


@pytest.mark.parametrize("text,message", [
    ('[vllm]\nmax-model-len = 4096\n[serve]\n', "unknown key"),
    ('[memory]\nheadroom = 3\n', "unknown \\[memory\\] key"),
    ('[vllm\n', "not valid TOML"),
])
def test_bad_preset_files_are_refused(tmp_path, text, message):
    path = tmp_path / "mine.toml"
    path.write_text(text)
    with pytest.raises(LaunchError, match=message):
        load_preset(str(path), {})
    with pytest.raises(LaunchError, match="no preset 'nope'"):
        load_preset("nope", {})


def test_a_preset_based_on_another_adds_to_it(tmp_path):
    """spec-ngram is spark-1x plus the drafts: the base's tables, its own keys winning."""
    base, ngram = load_preset("spark-1x", {}), load_preset("spec-ngram", {})
    assert ngram.nodes == base.nodes == 1 and ngram.memory == base.memory
    assert ngram.vllm == {**base.vllm, "speculative-config": ngram.vllm["speculative-config"]}
    assert json.loads(ngram.vllm["speculative-config"])["method"] == "ngram"
    mtp = load_preset("spec-mtp", {})  # the same way: spark-1x plus one MTP draft token a step
    assert mtp.nodes == base.nodes and mtp.memory == base.memory
    assert mtp.vllm == {**base.vllm, "speculative-config": mtp.vllm["speculative-config"]}
    assert json.loads(mtp.vllm["speculative-config"]) == {"method": "mtp", "num_speculative_tokens": 1}
    (tmp_path / "mine.toml").write_text('base = "spark-1x"\nnodes = 2\n[vllm]\nmax-num-seqs = 2\n'
                                        '[memory]\nheadroom-gib = 9.0\n')
    mine = load_preset(str(tmp_path / "mine.toml"), {})
    assert mine.nodes == 2 and mine.vllm["max-num-seqs"] == 2 and mine.vllm["max-model-len"] == 65536
    assert mine.memory.headroom_gib == 9.0 and mine.memory.min_context == base.memory.min_context
    (tmp_path / "a.toml").write_text('base = "b"\n')
    (tmp_path / "b.toml").write_text('base = "a"\n')
    with pytest.raises(LaunchError, match="leads back to this preset"):
        load_preset("a", {"VLLM_EXL3_PRESET_DIR": str(tmp_path)})


def test_preset_search_path_prefers_the_environment(tmp_path):
    (tmp_path / "spark-1x.toml").write_text('description = "mine"\n[vllm]\nmax-num-seqs = 1\n')
    assert load_preset("spark-1x", {"VLLM_EXL3_PRESET_DIR": str(tmp_path)}).description == "mine"


def test_the_plan_reads_the_users_values_as_vllm_does():
    """The user's explicit values, in spellings a name-based reader missed, are checked, not replaced."""
    spec = build_spec("single", load_preset("spark-1x", {}), {}, ["--max_model_len", "100", "--max-model=2k",
                                                                  "--kv-cache-memory", "1G", "--gpu-memory-util", "0.5",
                                                                  "--enforce-eager", "--kv-cache-dtype", "fp8"])
    request = plan_request(spec, parsed(spec))
    assert request.max_model_len == 2000 and request.max_model_len_pinned
    assert request.kv_cache_memory_bytes == 2**30 and request.gpu_memory_utilization == 0.5
    assert request.enforce_eager and request.kv_cache_dtype == "fp8" and request.max_num_seqs == 8
    preset_only = build_spec("single", load_preset("spark-1x", {}), {})
    request = plan_request(preset_only, parsed(preset_only))
    assert request.max_model_len == 65536 and not request.max_model_len_pinned  # the preset's wish
    assert request.gpu_memory_utilization is None and not request.enforce_eager


def test_plan_figures_and_threshold_follow_the_context():
    spec = build_spec("single", load_preset("spark-1x", {}), {})
    small = pairs(apply_plan(spec, 512, 0.61).argv())
    assert small["max-model-len"] == "512" and small["gpu-memory-utilization"] == "0.61"
    assert small["long-prefill-token-threshold"] == "512"  # vLLM refuses a threshold above the context
    assert pairs(apply_plan(spec, 65536).argv())["long-prefill-token-threshold"] == "1024"
    assert "gpu-memory-utilization" not in pairs(apply_plan(spec, 65536).argv())
    # the user's own context wins over the plan's, and the threshold follows the one vLLM will use
    assert pairs(apply_plan(spec, 65536, pinned_len=600).argv())["long-prefill-token-threshold"] == "600"


def test_exec_goes_through_the_cli_shim():
    assert exec_argv(["vllm", "serve", "/m", "--headless"]) == [sys.executable, "-m", "vllm_exl3.integration.vllm_cli",
                                                                 "serve", "/m", "--headless"]


@pytest.mark.parametrize("preset,role", list(preset_role_pairs()))
def test_every_command_parses_with_vllms_own_serve_parser(preset, role):
    """The argv the launcher builds is accepted by vLLM's `serve` parser, flag by flag and value by value."""
    from vllm.entrypoints.cli.serve import ServeSubcommand
    from vllm.utils.argparse_utils import FlexibleArgumentParser

    spec = apply_plan(build_spec(role, load_preset(preset, {}), TWO_NODE_ENV | {"VLLM_API_KEY": "k"}), 4096, 0.8,
                      12 * 2**30)
    parser = FlexibleArgumentParser()
    ServeSubcommand().subparser_init(parser.add_subparsers(dest="subparser"))
    args = parser.parse_args(spec.argv()[1:])
    assert args.model_tag == "/model"
    assert args.tensor_parallel_size == ROLES[role].nnodes and args.nnodes == ROLES[role].nnodes
    assert args.headless == ROLES[role].headless and args.long_prefill_token_threshold == 1024
    assert args.max_model_len == 4096 and args.gpu_memory_utilization == 0.8
    assert args.kv_cache_memory_bytes == 12 * 2**30
    assert args.shutdown_timeout == load_preset(preset, {}).vllm["shutdown-timeout"]
    if not ROLES[role].headless:  # the key on every path, 503 while draining, idle connections closed
        assert args.middleware == ["vllm_exl3.appliance.api_guard.GuardAllPaths"] and args.host == "0.0.0.0"


# --- the CLI ---------------------------------------------------------------------------------------------------
def launch(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess:
    base = {"PATH": "/usr/bin:/bin", "VLLM_EXL3_MODEL": str(demo.PACK)}
    return subprocess.run([sys.executable, "-m", "vllm_exl3.cli", "launch", *args], capture_output=True, text=True,
                          env=base | (env or {}), timeout=300)


def test_dry_run_prints_the_checked_command():
    r = launch("--role", "single", "--dry-run", env={"VLLM_EXL3_SERVED_NAME": "demo"})
    assert r.returncode == 0, r.stderr
    assert r.stdout.count("\n") == 1  # stdout is exactly the command
    assert r.stdout.startswith(f"vllm serve {demo.PACK} ") and "--served-model-name demo" in r.stdout
    assert "--max-model-len 1024" in r.stdout  # the demo model's own maximum caps the preset's 65536
    assert "preflight: ok   pack" in r.stderr and "57 EXL3 linears" in r.stderr


def test_dry_run_with_a_memory_figure_that_cannot_boot_is_refused(tmp_path):
    meminfo = tmp_path / "meminfo"  # a Spark with almost everything in use, much of it page cache
    meminfo.write_text("MemTotal:       125000000 kB\nMemFree:          6000000 kB\nMemAvailable:     9000000 kB\n")
    r = launch("--role", "single", "--dry-run", "--meminfo", str(meminfo))
    assert r.returncode == EXIT_REFUSED
    assert "memory plan: REFUSED" in r.stderr and "host reserve 6.0 GiB -> 2.6 GiB usable" in r.stderr
    assert "refused before starting vLLM" in r.stderr


def test_dry_run_on_unified_memory_hands_vllm_an_exact_kv_size(tmp_path):
    meminfo = tmp_path / "meminfo"  # an idle Spark
    meminfo.write_text("MemTotal:       125000000 kB\nMemFree:        100000000 kB\nMemAvailable:   120000000 kB\n")
    r = launch("--role", "single", "--dry-run", "--meminfo", str(meminfo))
    assert r.returncode == 0, r.stderr
    f = pairs(r.stdout.split())
    assert f["gpu-memory-utilization"] == "0.88" and int(f["kv-cache-memory-bytes"]) > 0
    assert f"--kv-cache-memory-bytes {f['kv-cache-memory-bytes']} " in r.stderr  # the plan's line says the same
    r = launch("--role", "single", "--dry-run", "--meminfo", str(meminfo), "--", "--kv-cache-memory-bytes", "lots")
    assert r.returncode == EXIT_REFUSED and "Traceback" not in r.stderr
    assert "the arguments after `--`: argument --kv-cache-memory-bytes: Value lots cannot be converted to " \
        "human_readable_int" in r.stderr


def test_cli_usage_errors():
    assert launch("--dry-run").returncode == 2
    r = launch("--role", "head", "--dry-run")
    assert r.returncode == 2 and "HEAD_ADDR" in r.stderr
    r = launch("--list-presets")
    assert r.returncode == 0 and all(name in r.stdout for name in SPARK_PRESETS)
