"""`vllm-exl3 inspect / verify / dequant` as a user runs them (a real subprocess of the console entry)."""

from __future__ import annotations

import json
import subprocess
import sys

import torch
from safetensors import safe_open
from safetensors.torch import load_file

from vllm_exl3.format import reference as R
from vllm_exl3.format.pack import Pack
from vllm_exl3.format.tensors import load_weights

from support.fixtures import pack_dir


def cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "vllm_exl3.cli", *args], capture_output=True, text=True,
                          timeout=300)


def test_inspect_json():
    pack = pack_dir("glm4moe-a-exl3-mcg-b4")
    r = cli("inspect", str(pack), "--json")
    assert r.returncode == 0, r.stderr
    s = json.loads(r.stdout)
    assert s["architecture"] == "Glm4MoeForCausalLM" and s["num_layers"] == 3 and s["num_experts"] == 8
    assert s["bits_histogram"] == {"4 mcg": 69, "6 mcg": 1}
    assert s["groups"]["experts"]["tensors"] == 48  # layers 1-2, 8 experts, 3 projections
    assert s["groups"]["head"]["tensors"] == 1
    stored = sum(f.stat().st_size for f in pack.glob("*.safetensors"))
    header = sum(f.data_start for f in Pack.open(pack).files)
    assert s["total_bytes"] == stored - header  # every byte of tensor data is accounted for, once
    assert 4.0 < s["groups"]["experts"]["bits_per_weight"] < 4.3  # 4 bits + suh/svh overhead


def test_inspect_table_names_the_groups():
    r = cli("inspect", str(pack_dir("qwen3moe-a-exl3-mul1-b2.5")))
    assert r.returncode == 0
    for word in ("Qwen3MoeForCausalLM", "2.5 mul1", "experts", "unquantized", "bits/weight"):
        assert word in r.stdout


def test_verify_ok_and_failures(tmp_path):
    assert cli("verify", str(pack_dir("qwen3moe-a-exl3-mcg-b3"))).returncode == 0
    import shutil

    broken = tmp_path / "broken"
    shutil.copytree(pack_dir("qwen3moe-a-exl3-mcg-b3"), broken)
    data = bytearray((broken / "model.safetensors").read_bytes())
    data[-10:] = b""  # truncated download
    (broken / "model.safetensors").write_bytes(bytes(data))
    r = cli("verify", str(broken))
    assert r.returncode == 1
    assert "model.safetensors" in r.stderr and "past end-of-file" in r.stderr and "FAIL" in r.stderr


def test_dequant_full_weights_in_hf_layout(tmp_path):
    pack = pack_dir("qwen3moe-a-exl3-mcg-b3")
    out = tmp_path / "w.safetensors"
    r = cli("dequant", str(pack), "-o", str(out), "--tensor", "model.layers.0.self_attn.*")
    assert r.returncode == 0, r.stderr
    got = load_file(out)
    assert sorted(got) == [f"model.layers.0.self_attn.{p}.weight" for p in ("k_proj", "o_proj", "q_proj", "v_proj")]
    lins = Pack.open(pack).linears()
    w = load_weights(lins["model.layers.0.self_attn.k_proj"])
    expected = R.full_weight(w).t()  # HF (out, in)
    assert got["model.layers.0.self_attn.k_proj.weight"].dtype == torch.float32
    assert torch.equal(got["model.layers.0.self_attn.k_proj.weight"], expected)


def test_dequant_rotated_is_bit_exact_with_exllamav3(tmp_path):
    pack = pack_dir("qwen3moe-a-exl3-mul1-b2.5")
    out = tmp_path / "w_hat.safetensors"
    assert cli("dequant", str(pack), "-o", str(out), "--rotated", "--tensor", "model.layers.0.*").returncode == 0
    golden = load_file(pack / "golden" / "recon_inner.safetensors")
    with safe_open(out, "pt") as f:
        names = list(f.keys())
        assert len(names) == 28  # 4 attention + 8 experts x 3
        for name in names:
            assert torch.equal(f.get_tensor(name), golden[name.removesuffix(".weight")]), name


def test_dequant_with_no_match(tmp_path):
    r = cli("dequant", str(pack_dir("qwen3moe-a-exl3-mcg-b3")), "-o", str(tmp_path / "x.safetensors"),
            "--tensor", "nothing.*")
    assert r.returncode == 1 and "no EXL3 linear matches" in r.stderr
    assert not (tmp_path / "x.safetensors").exists()
