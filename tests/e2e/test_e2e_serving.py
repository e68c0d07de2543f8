"""End to end on vLLM's CPU build: EXL3 packs served by the real OpenAI server through the plugin."""

from __future__ import annotations

import json
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
from safetensors.torch import load_file, save_file

from support.fixtures import PACKS, pack_dir
from vllm_exl3 import demo
from vllm_exl3.dev import golden_logprobs
from support.appliance import alive
from support.servers import (BOOT_TIMEOUT_S, SideBySide, cpu_env, free_port, port_is_free, server_argv, stop,
                             vllm_leftovers, vllm_server)
from vllm_exl3.appliance.health import descendants

pytestmark = pytest.mark.e2e

EAGER_FP32 = ("--dtype", "float32", "--enforce-eager")
PROMPTS = ["def fibonacci(n):", "The history of the city begins"]


def logprob_report(server, golden) -> tuple[float, float]:
    report = golden_logprobs.compare(server.base_url, server.model, golden["input_ids"], golden["logits"])
    return report.top1_agreement, report.median_abs_logprob_delta


def greedy(server, n=16) -> list[list[int]]:
    out = []
    for p in PROMPTS:
        r = server.post("/v1/completions", prompt=p, max_tokens=n, temperature=0, logprobs=0,
                        return_tokens_as_token_ids=True)
        out.append([int(t.split(":")[1]) for t in r["choices"][0]["logprobs"]["tokens"]])
    assert all(len(t) == n for t in out)
    return out


EXTENDED = "extended-contract"  # extended_contract_pack(qwen3moe-a-exl3-mul1-b4), served beside that pack


@pytest.fixture(scope="module")
def eager(tmp_path_factory):
    """pack -> (greedy tokens, (top-1 agreement, median |delta log p|) against its ExLlamaV3 golden), from one eager
    fp32 single-rank server per fixture pack (a boot costs ~40 s of CI): the golden comparison and the single-rank
    reference of the parallel and compiled tests alike; EXTENDED -> (None, its golden comparison). The servers
    boot two at a time side by side (support/servers.py SideBySide). The greedy requests go first, to a fresh
    server as before; vLLM reads no prefix cache for the prompt_logprobs request."""

    def spec(pack: str):
        if pack == EXTENDED:
            src = pack_dir("qwen3moe-a-exl3-mul1-b4")
            model = extended_contract_pack(src, tmp_path_factory.mktemp("extended"))
        else:
            src = model = pack_dir(pack)
        golden = load_file(src / "golden" / "logits.safetensors")
        return (model, tmp_path_factory.mktemp("eager"), EAGER_FP32, None), golden

    def measure(pack: str, server, golden):
        tokens = None if pack == EXTENDED else greedy(server)
        return tokens, logprob_report(server, golden)

    return SideBySide([*PACKS, EXTENDED], spec, measure)


@pytest.mark.parametrize("pack", PACKS)
def test_prompt_logprobs_match_exllamav3(pack, eager):
    _, (agree, median) = eager(pack)
    assert agree >= 0.97, agree
    assert median <= 0.05, median


@pytest.mark.parametrize("parallel", [("-tp", "2"), ("-tp", "2", "--enable-expert-parallel")],
                         ids=["tensor-parallel", "expert-parallel"])
def test_parallel_matches_single_rank(parallel, eager, tmp_path):
    """GLM-4-MoE (dense first layer, shared expert, router bias) at TP=2: k/v and the expert intermediate
    split inside 128-blocks (64 features per rank), exercising the block-halo path; EP holds 4 experts per rank."""
    single, _ = eager("glm4moe-a-exl3-mcg-b4")
    with vllm_server(pack_dir("glm4moe-a-exl3-mcg-b4"), tmp_path, *EAGER_FP32, *parallel) as server:
        assert greedy(server) == single


def test_half_integer_pack_tensor_parallel(eager, tmp_path):
    single, _ = eager("qwen3moe-a-exl3-mul1-b2.5")
    with vllm_server(pack_dir("qwen3moe-a-exl3-mul1-b2.5"), tmp_path, *EAGER_FP32, "-tp", "2") as server:
        assert greedy(server) == single


def test_compiled_cpu_graph_matches_eager(eager, tmp_path):
    """Without --enforce-eager vLLM's CPU build traces the model (and our MoE apply) with torch.compile;
    our custom ops with fake implementations must keep the graph whole and the tokens identical. The same with
    the router gates on the plugin's backend (VLLM_EXL3_ROUTER_GATE=1: vLLM's GateLinear calls our method; here
    the torch reference's fp32 product), booted beside it."""
    eager_tokens, _ = eager("qwen3moe-a-exl3-mcg-b3")
    pack = pack_dir("qwen3moe-a-exl3-mcg-b3")
    compiled = tmp_path / "compiled"
    gate = tmp_path / "router-gate"
    compiled.mkdir(), gate.mkdir()
    with vllm_server(pack, compiled, "--dtype", "float32") as server, \
            vllm_server(pack, gate, "--dtype", "float32", env=cpu_env(VLLM_EXL3_ROUTER_GATE="1")) as gated:
        assert greedy(server) == eager_tokens
        assert greedy(gated) == eager_tokens
    (log,) = gate.glob("vllm-*.log")
    assert "EXL3 router_gate:fp32:cpu -> torch backend" in log.read_text()


def test_broken_pack_fails_startup_with_our_error(tmp_path):
    pack = tmp_path / "broken"
    shutil.copytree(pack_dir("qwen3moe-a-exl3-mul1-b4"), pack, ignore=shutil.ignore_patterns("golden"))
    tensors = load_file(pack / "model.safetensors")
    del tensors["model.layers.1.mlp.experts.3.up_proj.svh"]
    save_file(tensors, str(pack / "model.safetensors"), metadata={"format": "pt"})
    proc = subprocess.run(server_argv(pack, free_port(), *EAGER_FP32), env=cpu_env(), capture_output=True,
                          text=True, timeout=180)
    out = proc.stdout + proc.stderr
    assert proc.returncode != 0
    assert "model.layers.1.mlp.experts.3.up_proj.svh" in out and "missing companion" in out
    assert "cannot be served" in out  # our own log line, before vLLM wraps the error
    assert "Loading weights" not in out  # refused while building the config, before any weight was read


def test_plain_vllm_serve_refuses_a_nan_scale_and_a_missing_tensor(tmp_path):
    """Plain `vllm serve` (no launcher, no preflight) on two mutants that used to boot healthy and answer empty
    text: the plugin's own check refuses both while vLLM builds its config, with our error."""
    from support.mutants import ST, copy_pack, entries, read_raw, rebuild, write_raw

    source = pack_dir("qwen3moe-a-exl3-mul1-b4")
    nan = copy_pack(source, tmp_path / "nan-scale")
    header, data = read_raw(nan / ST)
    begin = header["model.layers.1.self_attn.o_proj.svh"]["data_offsets"][0]
    write_raw(nan / ST, header, data[:begin] + b"\x00\x7e" + data[begin + 2:])  # fp16 NaN
    missing = copy_pack(source, tmp_path / "no-k-proj")
    t = entries(missing / ST)
    rebuild(missing / ST, {k: v for k, v in t.items() if not k.startswith("model.layers.0.self_attn.k_proj.")})
    procs = {root: subprocess.Popen(server_argv(root, free_port(), *EAGER_FP32), env=cpu_env(), text=True,
                                    stdout=subprocess.PIPE, stderr=subprocess.STDOUT, start_new_session=True)
             for root in (nan, missing)}
    outs = {}
    try:
        for root, proc in procs.items():
            try:
                outs[root] = proc.communicate(timeout=BOOT_TIMEOUT_S)[0]
            except subprocess.TimeoutExpired:  # it booted: the fault got through
                stop(proc)
                outs[root] = proc.communicate()[0]
    finally:
        for proc in procs.values():
            stop(proc)
    for root, wanted in ((nan, "tensor 'model.layers.1.self_attn.o_proj.svh': expected finite F16 scales"),
                         (missing, "tensor 'model.layers.0.self_attn.k_proj': expected an EXL3 linear")):
        out = outs[root]
        assert procs[root].returncode != 0, out[-3000:]
        assert wanted in out and "cannot be served" in out, out[-3000:]
        assert "Loading weights" not in out and "Application startup complete" not in out


@pytest.fixture(scope="module")
def serve_once(tmp_path_factory):
    """Two `vllm-exl3 serve --once` runs side by side (one boot's wait): "demo" with --demo, "no-template" on a copy
    of the bundled pack without --demo (so without a chat template; through the installed console script).
    name -> (subprocess.CompletedProcess, port, vLLM log or None)."""
    tmp = tmp_path_factory.mktemp("serve-once")
    pack = tmp / "tiny"
    shutil.copytree(demo.PACK, pack)
    script = Path(sys.executable).parent / "vllm-exl3"
    console = str(script) if script.exists() else shutil.which("vllm-exl3") or pytest.skip("no vllm-exl3 script")
    demo_port = free_port()
    plain_port = free_port()
    while plain_port == demo_port:
        plain_port = free_port()
    log = tmp / "vllm.log"
    argvs = {"demo": ([sys.executable, "-m", "vllm_exl3.cli", "serve", "--demo", "--once", "--port", str(demo_port)],
                      demo_port, None),
             "no-template": ([console, "serve", str(pack), "--once", "--port", str(plain_port), "--log", str(log)],
                             plain_port, log)}
    procs = {name: subprocess.Popen(argv, env=cpu_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
             for name, (argv, _, _) in argvs.items()}
    runs = {}
    try:
        for name, proc in procs.items():
            out, err = proc.communicate(timeout=300)
            runs[name] = (subprocess.CompletedProcess(proc.args, proc.returncode, out, err), *argvs[name][1:])
    finally:
        for proc in procs.values():
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return runs


def test_cli_serve_demo_answers(serve_once):
    """README's main job: `vllm-exl3 serve --demo --once` serves the bundled pack and answers."""
    proc, _, _ = serve_once["demo"]
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "healthy after" in proc.stdout and "completion (" in proc.stdout and "chat (" in proc.stdout


def test_serve_a_pack_without_chat_template_answers_and_skips_chat(serve_once):
    """The bundled pack's tokenizer has no chat template: without --demo's template, serve must still work.
    (Was in tests/cli/test_cli_errors.py; here it boots beside the --demo run.)"""
    r, port, log = serve_once["no-template"]
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    assert r.returncode == 0, r.stdout + r.stderr
    assert "HTTP     completion (" in r.stdout and "chat: skipped" in r.stdout and "--chat-template" in r.stdout
    assert f"log: {log}" in r.stdout and "Application startup complete" in log.read_text()
    assert "backend  " in r.stdout and "next:" in r.stdout
    # What serve guarantees when it returns: nothing of vLLM left, the port free (not how fast vLLM's engine
    # exits: on a loaded machine vLLM may force-kill it after --shutdown-timeout, which is vLLM's business)
    assert vllm_leftovers(log.read_text()) == [] and port_is_free(port)


def test_cli_serve_stops_vllm_however_it_is_stopped(tmp_path):
    """`timeout`, systemd and CI stop `vllm-exl3 serve` with SIGTERM, and a kill -9 leaves it no chance to clean
    up: either way vLLM's API server and engine go too, and the port is free again. One serve per signal, booted
    side by side (one boot's wait)."""
    sigs = (signal.SIGTERM, signal.SIGKILL)
    procs: dict[signal.Signals, subprocess.Popen] = {}
    ports: dict[signal.Signals, int] = {}
    lines: dict[signal.Signals, list[str]] = {sig: [] for sig in sigs}
    readers: dict[signal.Signals, threading.Thread] = {}
    trees: dict[signal.Signals, set[int]] = {sig: set() for sig in sigs}
    try:
        for sig in sigs:
            port = free_port()
            while port in ports.values():  # handed out for the other serve, not bound yet
                port = free_port()
            ports[sig] = port
            procs[sig] = proc = subprocess.Popen(
                [sys.executable, "-m", "vllm_exl3.cli", "serve", "--demo", "--port", str(port), "--log",
                 str(tmp_path / f"vllm-{sig.name}.log")], env=cpu_env(), stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT, text=True, start_new_session=True)
            readers[sig] = threading.Thread(target=lambda out=proc.stdout, into=lines[sig]: into.extend(out),
                                            daemon=True)
            readers[sig].start()
        deadline = time.monotonic() + 300
        for sig, proc in procs.items():
            while not any(line.startswith("serving  ") for line in lines[sig]):
                assert proc.poll() is None and time.monotonic() < deadline, (sig.name, "".join(lines[sig])[-3000:])
                time.sleep(0.5)
        for sig, proc in procs.items():
            trees[sig] = descendants(proc.pid) - {proc.pid}
            assert len(trees[sig]) >= 2, (sig.name, trees[sig])  # vLLM's API server and its engine core
        for sig, proc in procs.items():
            os.kill(proc.pid, sig)
        for sig, proc in procs.items():
            assert proc.wait(120) == (128 + signal.SIGTERM if sig == signal.SIGTERM else -signal.SIGKILL), sig.name
        deadline = time.monotonic() + 120
        while [p for tree in trees.values() for p in tree if alive(p)] and time.monotonic() < deadline:
            time.sleep(0.5)
        for sig in sigs:
            assert not [p for p in trees[sig] if alive(p)], f"vLLM outlived `vllm-exl3 serve` ({sig.name})"
            with socket.socket() as s:
                s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)  # as vLLM binds: TIME_WAIT is no listener
                s.bind(("127.0.0.1", ports[sig]))  # nothing listens on the port any more
            readers[sig].join(10)
        assert "stopping vLLM ..." in "".join(lines[signal.SIGTERM])
    finally:
        for sig, proc in procs.items():
            for pid in [proc.pid, *trees[sig]]:
                try:
                    os.kill(pid, signal.SIGKILL)
                except ProcessLookupError:
                    pass
            proc.wait()


def test_cli_serve_killed_while_vllm_boots_leaves_nothing(tmp_path):
    """A kill -9 of `vllm-exl3 serve` while vLLM boots: vLLM booted on and served with no parent (the kernel's
    SIGTERM reaches a booting vLLM, which does not act on it). serve's guard stops what is left of it."""
    port, log = free_port(), tmp_path / "vllm.log"
    proc = subprocess.Popen([sys.executable, "-m", "vllm_exl3.cli", "serve", "--demo", "--port", str(port), "--log",
                             str(log)], env=cpu_env(), stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT,
                            start_new_session=True)
    tree: set[int] = set()
    try:
        deadline = time.monotonic() + 300
        while "(EngineCore pid=" not in (log.read_text() if log.exists() else ""):  # its engine is loading
            assert proc.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
            time.sleep(0.2)
        tree = descendants(proc.pid) - {proc.pid}
        os.kill(proc.pid, signal.SIGKILL)
        proc.wait(30)
        deadline = time.monotonic() + 180  # the guard's grace, and a loaded machine
        while (vllm_leftovers(log.read_text()) or [p for p in tree if alive(p)]) and time.monotonic() < deadline:
            time.sleep(1)
        assert not vllm_leftovers(log.read_text()) and not [p for p in tree if alive(p)], log.read_text()[-3000:]
        assert port_is_free(port)
    finally:
        for pid in [proc.pid, *tree, *vllm_leftovers(log.read_text() if log.exists() else "")]:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        proc.wait()


def test_cli_serve_refuses_a_broken_pack_before_starting_vllm(tmp_path):
    pack = tmp_path / "broken"
    shutil.copytree(demo.PACK, pack)
    (pack / "model.safetensors").write_bytes((pack / "model.safetensors").read_bytes()[:-4096])
    proc = subprocess.run([sys.executable, "-m", "vllm_exl3.cli", "serve", str(pack)], capture_output=True,
                          text=True, timeout=60)
    assert proc.returncode == 1
    assert "refusing to serve" in proc.stderr and "past end-of-file" in proc.stderr
    assert "starting vLLM" not in proc.stdout


def extended_contract_pack(src, tmp_path):
    """A copy of `src` in the extended contract other EXL3 tools write: routed experts (and the head) in EXL3, the
    attention of layer 1 as plain BF16 (`non_routed_dtype_policy: bf16_as_stored`), layer 0's q in EXL3 with
    k/v as BF16 shards of the same fused module (`non_routed_exl3` long form), `layer_bits` declared."""
    from vllm_exl3.format import dequant
    from vllm_exl3.format.pack import Pack

    pack = tmp_path / "experts-only"
    shutil.copytree(src, pack, ignore=shutil.ignore_patterns("golden", "quantization_config.json"))
    tensors = load_file(pack / "model.safetensors")
    plain = ["model.layers.0.self_attn.k_proj", "model.layers.0.self_attn.v_proj"] + [
        f"model.layers.1.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")]
    items = [i for i in dequant.plan(Pack.open(src), None, rotated=False, padded=False)
             if i.linear.prefix in plain]
    dequant.write(items, tmp_path / "plain.safetensors", rotated=False)
    for name, w in load_file(tmp_path / "plain.safetensors").items():
        prefix = name.removesuffix(".weight")
        for suffix in ("trellis", "suh", "svh", "mul1"):
            del tensors[f"{prefix}.{suffix}"]
        tensors[name] = w.bfloat16()
    save_file(tensors, str(pack / "model.safetensors"), metadata={"format": "pt"})
    config = json.loads((pack / "config.json").read_text())
    config["quantization_config"].update({
        "codebook": "mul1", "layer_bits": {"0": 4, "1": 4}, "non_routed_dtype_policy": "bf16_as_stored",
        "non_routed_exl3": {"layers": {"model.layers.0.self_attn.qkv_proj": {"bits": 4, "bf16_shards": [1, 2]}}}})
    (pack / "config.json").write_text(json.dumps(config))
    return pack


def test_extended_contract_routed_experts_only_pack(eager):
    """extended_contract_pack's pack (qwen3moe-a-exl3-mul1-b4 in the extended contract) serves within the same
    bounds of that pack's ExLlamaV3 golden (booted beside it: the eager fixture)."""
    _, (agree, median) = eager(EXTENDED)
    assert agree >= 0.97, agree
    assert median <= 0.05, median
