"""Every user mistake the CLI sees gets one clear paragraph and a non-zero exit, never a traceback; an unexpected
error prints one line and where the full trace went. All through the installed `vllm-exl3` console script."""

from __future__ import annotations

import json
import os
import shutil
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import save_file

from vllm_exl3 import __version__, demo

from support.fixtures import pack_dir
from support.servers import free_port

PACK = pack_dir("qwen3moe-a-exl3-mcg-b3")


def console_script() -> str:
    script = Path(sys.executable).parent / "vllm-exl3"
    return str(script) if script.exists() else shutil.which("vllm-exl3") or pytest.skip("no vllm-exl3 script")


def cli(*args: str, env: dict[str, str] | None = None, timeout: float = 300) -> subprocess.CompletedProcess:
    r = subprocess.run([console_script(), *args], capture_output=True, text=True, timeout=timeout,
                       env={**os.environ, **(env or {})})
    assert "Traceback" not in r.stderr + r.stdout, r.stderr
    return r


def plain_hf_model(root: Path) -> Path:
    """A model directory as Hugging Face ships it: config without quantization, plain bf16 tensors."""
    root.mkdir()
    (root / "config.json").write_text(json.dumps({"architectures": ["LlamaForCausalLM"], "model_type": "llama",
                                                 "hidden_size": 8, "num_hidden_layers": 1}))
    save_file({"model.layers.0.self_attn.q_proj.weight": torch.zeros(8, 8, dtype=torch.bfloat16)},
              str(root / "model.safetensors"))
    return root


def test_version():
    r = cli("--version")
    assert r.returncode == 0 and r.stdout.strip() == f"vllm-exl3 {__version__}"


def test_unknown_option_gets_the_subcommands_usage():
    r = cli("inspect", str(PACK), "--bogus")
    assert r.returncode == 2
    assert "usage: vllm-exl3 inspect" in r.stderr and "unrecognized arguments: --bogus" in r.stderr


def test_vllm_options_before_the_separator_are_refused_with_the_way_to_pass_them():
    r = cli("serve", str(PACK), "--max-model-len", "256")
    assert r.returncode == 2 and "after `--`" in r.stderr and "-- --max-model-len 256" in r.stderr


def test_separator_on_a_command_that_passes_nothing_to_vllm():
    r = cli("inspect", str(PACK), "--", "--x")
    assert r.returncode == 2 and "passes nothing to vLLM" in r.stderr


def test_broken_pipe_is_quiet():
    """`vllm-exl3 inspect --json PACK | head`: the reader went away before the output was written."""
    proc = subprocess.Popen([console_script(), "inspect", "--json", str(PACK)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True)
    proc.stdout.close()
    err = proc.stderr.read()
    assert proc.wait(120) == 141
    assert err == "", err


def test_inspect_and_dequant_refuse_a_plain_hf_model(tmp_path):
    model = plain_hf_model(tmp_path / "llama")
    r = cli("inspect", str(model))
    assert r.returncode == 1 and "is not an EXL3 pack" in r.stderr and "no quantization_config" in r.stderr
    assert r.stdout == ""
    r = cli("dequant", str(model), "-o", str(tmp_path / "w.safetensors"))
    assert r.returncode == 1 and "is not an EXL3 pack" in r.stderr and "None" not in r.stderr


def test_a_file_where_a_directory_is_expected(tmp_path):
    r = cli("inspect", str(PACK / "model.safetensors"))
    assert r.returncode == 1 and "a file (give the folder" in r.stderr and "no such" not in r.stderr
    r = cli("verify", str(tmp_path / "missing"))
    assert r.returncode == 1 and "no such file or directory" in r.stderr


def test_dequant_into_a_missing_folder(tmp_path):
    r = cli("dequant", str(PACK), "-o", str(tmp_path / "no" / "such" / "w.safetensors"))
    assert r.returncode == 1 and "does not exist" in r.stderr and "mkdir -p" in r.stderr
    r = cli("dequant", str(PACK), "-o", str(tmp_path))
    assert r.returncode == 1 and "is a directory" in r.stderr


@pytest.mark.parametrize("workers", ["a,b", "0", "1,-2", ""])
def test_load_bench_worker_counts(workers):
    r = cli("load-bench", str(PACK), "--workers", workers)
    assert r.returncode == 2 and "positive integers" in r.stderr and "usage: vllm-exl3 load-bench" in r.stderr


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the message on a machine without CUDA")
def test_load_bench_on_cuda_without_cuda():
    r = cli("load-bench", str(PACK), "--device", "cuda")
    assert r.returncode == 2 and "no usable CUDA device" in r.stderr


def test_load_bench_on_a_missing_pack(tmp_path):
    r = cli("load-bench", str(tmp_path / "nothing"))
    assert r.returncode == 1 and "no such model directory" in r.stderr


def test_serve_parses_its_options_after_the_pack():
    # --demo after PACK is ours (not vLLM's): both given is the user's mistake, reported at once
    r = cli("serve", str(PACK), "--once", "--demo")
    assert r.returncode == 2 and "give a PACK directory or --demo" in r.stderr


def test_serve_on_a_busy_port():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        port = s.getsockname()[1]
        r = cli("serve", str(demo.PACK), "--port", str(port), "--once")
    assert r.returncode == 1 and f"cannot serve on 127.0.0.1:{port}" in r.stderr and "--port N" in r.stderr
    assert "starting" not in r.stdout


@pytest.mark.parametrize("args,says", [
    (("serve", "--demo", "--port", "70000"), "argument --port: '70000' is not a TCP port"),
    (("metrics", "--port", "99999"), "argument --port: '99999' is not a TCP port"),
    (("load-bench", str(PACK), "--chunk-mib", "0"), "argument --chunk-mib: '0' is not a positive integer"),
    (("load-bench", str(PACK), "--repeats", "0"), "argument --repeats: '0' is not a positive integer"),
    (("load-bench", str(PACK), "--ring-mib", "-5"), "argument --ring-mib: '-5' is not a positive integer"),
])
def test_numbers_out_of_range_are_usage_errors(args, says):
    """Each was an "internal error" (OverflowError, ZeroDivisionError, a negative size)."""
    r = cli(*args)
    assert r.returncode == 2 and says in r.stderr and "internal error" not in r.stderr, r.stderr


def test_preflight_with_a_meminfo_that_is_not_one(tmp_path):
    for name, content in (("text", b"hello\n"), ("binary", bytes(range(256)))):
        (tmp_path / name).write_bytes(content)
        r = cli("preflight", str(demo.PACK), "--meminfo", str(tmp_path / name))
        assert r.returncode == 2 and "not a Linux meminfo file" in r.stderr, r.stderr
        assert "internal error" not in r.stderr


def test_launch_with_a_missing_meminfo_file(tmp_path):
    r = cli("launch", str(demo.PACK), "--role", "single", "--dry-run", "--meminfo", str(tmp_path / "spark.meminfo"))
    assert r.returncode == 2 and "no such file" in r.stderr and "/proc/meminfo" in r.stderr


def test_launch_and_preflight_take_the_pack_as_an_argument():
    r = cli("launch", str(demo.PACK), "--role", "single", "--dry-run")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"vllm serve {demo.PACK} ") and "preflight: ok   pack" in r.stderr
    r = cli("preflight", str(demo.PACK), "--", "--max-num-seqs", "4")
    assert r.returncode == 0, r.stderr
    assert r.stdout.startswith(f"vllm serve {demo.PACK} ") and r.stdout.rstrip().endswith("--max-num-seqs 4")
    assert "role single" in r.stderr


@pytest.mark.parametrize("args,reason", [
    (["--max-model-len", "abc"], "argument --max-model-len: invalid human_readable_int_or_auto value: 'abc'"),
    (["--bogus-flag", "3"], "unrecognized arguments: --bogus-flag 3"),
    (["--max-num-seqs"], "argument --max-num-seqs: expected one argument"),
    (["--kv-cache-dtype", "fp7"], "argument --kv-cache-dtype: invalid choice: 'fp7'"),
    (["--max-num", "4"], "ambiguous option: --max-num could match"),
    # vLLM's parser itself failed (IndexError: list index out of range, reported as its traceback's last line)
    (["--hf-overrides.x"], "vLLM's parser could not read --hf-overrides.x (IndexError: list index out of range): "
                           "a dotted option takes a value"),
])
def test_preflight_checks_vllms_options_with_vllms_parser(args, reason):
    """Before: "internal error ... please include it in a bug report", or "ok" and a command vLLM rejects."""
    r = cli("preflight", str(demo.PACK), "--", *args)
    assert r.returncode == 78, r.stderr
    assert f"REFUSED: vLLM refuses the options: the arguments after `--`: {reason}" in r.stderr, r.stderr
    assert "internal error" not in r.stderr and r.stdout == ""  # no command vLLM would reject


def test_preflight_and_serve_refuse_a_context_above_the_models_own_limit():
    """vLLM's own ModelConfig, built from the options and the pack: preflight said ok and serve failed a minute
    into the boot with a pydantic traceback. The preset's longer context is not a problem (the plan caps it)."""
    r = cli("preflight", str(demo.PACK), "--", "--max-model-len", "100000")
    assert r.returncode == 78, r.stderr
    assert ("FAIL vLLM model config: --max-model-len 100000 is above the model's maximum context, 1024 tokens"
            in r.stderr), r.stderr
    r = cli("serve", str(demo.PACK), "--once", "--port", str(free_port()), "--", "--max-model-len", "100000")
    assert r.returncode == 2 and "refusing to serve: --max-model-len 100000 is above" in r.stderr, r.stderr
    assert "vLLM     log" not in r.stdout  # nothing started


def test_preflight_and_serve_refuse_a_delegate_method_vllm_does_not_have(tmp_path):
    """`non_routed_quantization` naming a method this vLLM lacks passed every gate; the load failed minutes later."""
    pack = Path(shutil.copytree(demo.PACK, tmp_path / "pack"))
    config = json.loads((pack / "config.json").read_text())
    config["quantization_config"]["non_routed_quantization"] = {"quant_method": "fp9"}
    (pack / "config.json").write_text(json.dumps(config))
    says = "config.json: quantization_config: non_routed_quantization: quant_method 'fp9' is not a quantization method"
    r = cli("preflight", str(pack))
    assert r.returncode == 78 and f"FAIL vLLM model config: {says}" in r.stderr, r.stderr
    r = cli("serve", str(pack), "--once", "--port", str(free_port()))
    assert r.returncode == 2 and f"refusing to serve: {says}" in r.stderr.replace("\n", " "), r.stderr


def test_serve_checks_vllms_options_before_starting_anything():
    r = cli("serve", str(demo.PACK), "--once", "--port", str(free_port()), "--", "--bogus-flag", "3")
    assert r.returncode == 2 and "unrecognized arguments: --bogus-flag 3" in r.stderr, r.stderr
    assert "vLLM     log" not in r.stdout  # nothing started


@pytest.mark.parametrize("args", [["--host", "0.0.0.0"], ["--", "--ho", "0.0.0.0"], ["--", "--host=::"]])
def test_serve_binds_like_the_appliance(args):
    """An address beyond loopback without VLLM_API_KEY is refused, in any spelling vLLM reads."""
    r = cli("serve", str(demo.PACK), "--once", "--port", str(free_port()), *args, env={"VLLM_API_KEY": ""})
    assert r.returncode == 2, r.stdout + r.stderr
    assert "refusing to serve: the API would listen on every interface with no key" in r.stderr
    assert "--host 127.0.0.1" in r.stderr and "vLLM     log" not in r.stdout


def test_preflight_refuses_a_missing_pack(tmp_path):
    r = cli("preflight", str(tmp_path / "model"))
    assert r.returncode == 78 and "FAIL pack" in r.stderr


def test_worker_dry_run_before_the_head_is_up():
    r = cli("preflight", str(demo.PACK), "--role", "worker",
            env={"VLLM_EXL3_HEAD_ADDR": "127.0.0.1", "VLLM_EXL3_MASTER_PORT": str(free_port()),
                 "VLLM_EXL3_PEER_SECRET": "0123456789abcdef"})
    assert r.returncode == 0, r.stderr
    assert "preflight: --   head rendezvous:" in r.stderr and "not checked" in r.stderr
    assert "--headless" in r.stdout


def test_unexpected_error_prints_one_line_and_the_trace_file(tmp_path):
    """A bug (here: injected into the report code at start-up) is one line plus the path of the full trace."""
    (tmp_path / "sitecustomize.py").write_text(
        "import vllm_exl3.format.summary as r\n"
        "def boom(*a, **k):\n"
        "    raise RuntimeError('injected failure')\n"
        "r.summarize = boom\n")
    path = os.pathsep.join([str(tmp_path), *filter(None, [os.environ.get("PYTHONPATH")])])
    r = cli("inspect", str(PACK), env={"PYTHONPATH": path, "TMPDIR": str(tmp_path)})
    assert r.returncode == 70
    assert "internal error: RuntimeError: injected failure" in r.stderr
    (trace,) = tmp_path.glob("vllm-exl3-error-*.txt")
    assert str(trace) in r.stderr and "Traceback" in trace.read_text() and "injected failure" in trace.read_text()
