"""The boot-time parity gate (kernels/parity.py) on real fixture-pack layers, with a deliberately broken backend
that exists only in this test (the torch reference with perturbed outputs)."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys

import pytest
import torch

from support.fixtures import pack_dir
from vllm_exl3.dev.synthetic import expert_stack
from vllm_exl3.format.pack import Pack
from vllm_exl3.format.tensors import load_weights
from vllm_exl3.kernels import backend as kbackend
from vllm_exl3.kernels import parity, selection
from support.backends import WrongNative
from vllm_exl3.kernels.backends.torch_ref import TorchBackend, TorchLinear
from vllm_exl3.kernels.interface import MoECall
from vllm_exl3.kernels.specs import LinearSpec, MoESpec


class NoisyLinear(TorchLinear):
    backend = "native"

    def __call__(self, x):
        y = super().__call__(x)
        return y + 0.1 * y.std() * torch.randn_like(y)


class Broken(WrongNative):
    """The reference plus 10 % noise (dense) or 10 % off (routed): the kind of silent wrong output the gate exists
    for."""

    def bind_linear(self, w, in_offset, out_offset, out_features):
        return NoisyLinear(w, in_offset, out_offset, out_features)


@pytest.fixture
def gate_env(monkeypatch, tmp_path):
    monkeypatch.setenv(parity.REPORT_ENV, str(tmp_path / "parity.json"))
    monkeypatch.setenv("VLLM_EXL3_KERNEL", "auto")
    monkeypatch.setattr(selection, "_excluded", {})
    kbackend.load_backends()
    parity.reset()
    yield tmp_path / "parity.json"
    parity.reset()


@pytest.fixture(scope="module")
def pack():
    return Pack.open(pack_dir("qwen3moe-a-exl3-mcg-b3"))


def bind_linear(w, log: list, decisions: list | None = None):
    """What Exl3LinearMethod._bind does through integration/binding.py, minus vLLM: choose, bind, gate; on the
    gate's fallback, bind again (selection skips the failed backend). Each binding records its backend."""
    spec = LinearSpec(w.codebook, w.bits, w.in_padded, w.out_padded, torch.float32, "cpu")
    decisions = [] if decisions is None else decisions

    def bind():
        b = selection.choose_linear_backend(spec)
        bound = b.bind_linear(w, 0, 0, w.out_padded)
        log.append(b.name)
        fallback = parity.gate("model.layers.0.self_attn.q_proj", selection.linear_layer_type(spec), b,
                               torch.float32, lambda: parity.linear_error(bound, w.in_padded, torch.float32), False)
        decisions.append(fallback)
        if fallback is not None:
            bind()

    bind()


def test_torch_reference_is_never_checked(gate_env, pack):
    log = []
    bind_linear(load_weights(pack.linears()["model.layers.0.self_attn.q_proj"]), log)
    assert log == ["torch"] and parity.checks() == []
    report = json.loads(gate_env.read_text())
    assert report["checks"] == [] and report["served"] == {"linear:mcg:3b:cpu": "torch"}


def test_fallback_moves_the_layer_type_to_the_next_backend_and_logs(gate_env, pack, monkeypatch, caplog):
    monkeypatch.setitem(kbackend.REGISTRY, "native", Broken())
    log = []
    with caplog.at_level(logging.INFO, logger="vllm_exl3.kernels"):
        decisions = []
        bind_linear(load_weights(pack.linears()["model.layers.0.self_attn.q_proj"]), log, decisions)
        assert log == ["native", "torch"]  # bound to the broken one, checked, bound again to the reference
        fallback, none = decisions  # the gate decides; the caller binds again
        assert none is None and (fallback.layer_type, fallback.backend) == ("linear:mcg:3b:cpu", "native")
        assert fallback.reason.startswith("failed the parity gate")
        log2 = []
        bind_linear(load_weights(pack.linears()["model.layers.1.self_attn.q_proj"]), log2)
        assert log2 == ["torch"]  # later layers of the type never see the failed backend
    [check] = parity.checks()
    assert not check.passed and check.backend == "native" and check.error > check.bound
    assert "differs from the torch reference" in caplog.text and "moves to the next backend" in caplog.text
    report = json.loads(gate_env.read_text())
    assert report["served"] == {"linear:mcg:3b:cpu": "torch"} and report["checks"][0]["passed"] is False


def test_strict_refuses_naming_layer_backend_and_error(gate_env, pack, monkeypatch):
    monkeypatch.setitem(kbackend.REGISTRY, "native", Broken())
    monkeypatch.setenv(parity.PARITY_ENV, "strict")
    with pytest.raises(parity.ParityError, match=r"model\.layers\.0\.self_attn\.q_proj .*native backend .*"
                                                 r"by \d\.\d+e[-+]\d+ relative \(bound 0\.01"):
        bind_linear(load_weights(pack.linears()["model.layers.0.self_attn.q_proj"]), [])


def test_off_checks_nothing(gate_env, pack, monkeypatch):
    monkeypatch.setitem(kbackend.REGISTRY, "native", Broken())
    monkeypatch.setenv(parity.PARITY_ENV, "off")
    log = []
    bind_linear(load_weights(pack.linears()["model.layers.0.self_attn.q_proj"]), log)
    assert log == ["native"] and parity.checks() == []


def test_a_correct_backend_passes_on_every_sampled_layer(gate_env, pack, monkeypatch):
    class Honest(TorchBackend):
        name = "native"

    monkeypatch.setitem(kbackend.REGISTRY, "native", Honest())
    log = []
    bind_linear(load_weights(pack.linears()["model.layers.0.self_attn.q_proj"]), log)
    [check] = parity.checks()
    assert check.passed and check.error < 1e-6 and log == ["native"]


def layer_experts(pack, layer: int):
    lin = pack.linears()
    weights = [[load_weights(lin[f"model.layers.{layer}.mlp.experts.{e}.{p}_proj"]) for p in ("gate", "up", "down")]
               for e in range(8)]
    return expert_stack(weights, list(range(8))), weights[0][0].in_padded


@pytest.mark.parametrize("policy", ["fallback", "strict"])
def test_routed_experts_gate(gate_env, pack, monkeypatch, policy):
    monkeypatch.setitem(kbackend.REGISTRY, "native", Broken())
    monkeypatch.setenv(parity.PARITY_ENV, policy)
    stack, hidden = layer_experts(pack, 1)
    spec = MoESpec(stack.codebooks, (3.0,) * 24, hidden, stack.w2_suh.shape[-1], 8, "silu", torch.float32, "cpu")
    log = []

    def bind():
        b = selection.choose_moe_backend(spec)
        bound = b.bind_moe(stack, MoECall("silu", top_k=2))
        log.append(b.name)
        if parity.gate("model.layers.1.mlp.experts", selection.moe_layer_type(spec), b, torch.float32,
                       lambda: parity.moe_error(bound, hidden, torch.float32), True):
            bind()

    if policy == "strict":
        with pytest.raises(parity.ParityError, match=r"model\.layers\.1\.mlp\.experts \(moe:mcg:3b:cpu\) on the "
                                                     r"native backend"):
            bind()
        return
    bind()
    assert log == ["native", "torch"]
    assert parity.checks()[0].inputs.startswith("64 tokens, top-2 of experts [0, 1, 2, 7]")


# -- where the report goes: one per server and rank -------------------------------------------------------------
API_SERVER = "/venv/lib/python3.11/site-packages/vllm/entrypoints/openai/api_server.py"


@pytest.mark.parametrize("argv,key", [
    (["/venv/bin/vllm", "serve", "/pack", "--port", "8011"], "port-8011"),
    (["/venv/bin/vllm", "serve", "/pack", "--max-model-len", "256", "--port=8012"], "port-8012"),
    (["/venv/bin/vllm", "serve", "/pack"], "port-8000"),
    ([API_SERVER, "--model", "/pack", "--port", "9000", "--host", "127.0.0.1"], "port-9000"),
    ([API_SERVER, "--model", "/pack"], "port-8000"),
    (["/venv/bin/vllm", "serve", "/pack", "--headless", "--port", "8013"], "headless"),
    (["/venv/bin/vllm", "bench", "serve", "--port", "8014"], "offline"),
    (["/venv/bin/pytest", "--port", "8015"], "offline"),
])
def test_the_server_a_process_serves_comes_from_its_command_line(argv, key):
    assert parity.server_key(argv) == key


def test_the_port_of_a_config_file(tmp_path):
    config = tmp_path / "serve.yaml"
    config.write_text("port: 8123\nmax-model-len: 256\n")
    assert parity.server_key(["/venv/bin/vllm", "serve", "/pack", "--config", str(config)]) == "port-8123"
    assert parity.server_key(["/venv/bin/vllm", "serve", "/pack", "--config", str(config), "--port", "1"]) == "port-1"


def test_each_server_keeps_its_own_report_and_info_shows_them(tmp_path, monkeypatch, pack, capsys):
    """Two servers on one machine (the server is its command line: each engine process inherits the API
    server's sys.argv); before, both wrote one machine-wide file and `info` showed whichever came last."""
    import tempfile

    from vllm_exl3.cli.main import main

    monkeypatch.delenv(parity.REPORT_ENV, raising=False)
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    monkeypatch.setattr(selection, "_excluded", {})
    kbackend.load_backends()
    for port in (8011, 8012):
        monkeypatch.setattr("sys.argv", [API_SERVER, "--model", "/pack", "--port", str(port)])
        parity.reset()
        bind_linear(load_weights(pack.linears()["model.layers.0.self_attn.q_proj"]), [])
    parity.reset()
    reports = parity.read_reports()
    assert [(r.path.name, r.body["server"], r.body["rank"]) for r in reports] == [
        ("port-8011.rank0.json", "port-8011", 0), ("port-8012.rank0.json", "port-8012", 0)]
    assert [r.body["server"] for r in parity.read_reports(port=8012)] == ["port-8012"]
    # one file named by VLLM_EXL3_PARITY_REPORT: --port still shows only that server's
    named = {parity.REPORT_ENV: str(reports[0].path)}
    assert [r.body["server"] for r in parity.read_reports(named, port=8011)] == ["port-8011"]
    assert parity.read_reports(named, port=8012) == []

    assert main(["info", "--port", "8011"]) == 0
    out = capsys.readouterr().out
    assert "parity gate of the server on port 8011, rank 0" in out and "8012" not in out, out
    (tmp_path / parity.REPORT_DIR / "port-8013.rank0.json").write_text("{half a rep")
    # a server that has exited: its report is kept (info --port shows it), listed in one line otherwise
    gone = subprocess.run([sys.executable, "-c", f"import sys; sys.argv = [{API_SERVER!r}, '--port', '8014']; "
                           "from vllm_exl3.kernels import parity; parity._write_report()"],
                          env={**os.environ, "TMPDIR": str(tmp_path)}, capture_output=True, text=True, timeout=120)
    assert gone.returncode == 0, gone.stderr
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    assert "port 8011" in out and "port 8012" in out and "port-8013.rank0.json cannot be read" in out, out
    assert "on port 8014" not in out and "1 more report(s) of processes that have exited (port-8014)" in out, out
    assert main(["info", "--port", "8014"]) == 0
    out = capsys.readouterr().out
    assert "parity gate of the server on port 8014, rank 0 (pid " in out and ", exited;" in out, out
