"""`vllm-exl3 pack index | config | overlay` and `verify --deep` on copies of the real fixture packs."""

from __future__ import annotations

import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from support.fixtures import pack_dir
from support.packs import copy_pack, dequantized_model
from vllm_exl3.cli.main import main
from vllm_exl3.format import deep, packtools
from vllm_exl3.format.constants import INDEX_FILE
from vllm_exl3.format.errors import Exl3FormatError
from vllm_exl3.format.pack import Pack, verify_pack

MCG = "qwen3moe-a-exl3-mcg-b3"
MUL1 = "qwen3moe-a-exl3-mul1-b4"


def split_in_two(root):
    """Re-shard a single-file pack into two files (experts, rest) without an index."""
    t = load_file(root / "model.safetensors")
    (root / "model.safetensors").unlink()
    save_file({k: v for k, v in t.items() if ".experts." in k}, root / "a.safetensors")
    save_file({k: v for k, v in t.items() if ".experts." not in k}, root / "b.safetensors")
    return t


def test_index_regenerates_checks_drift_and_refuses_duplicates(tmp_path, capsys):
    root = copy_pack(pack_dir(MCG), tmp_path / "p")
    tensors = split_in_two(root)
    assert main(["pack", "index", str(root), "--check"]) == 1  # no index yet
    assert main(["pack", "index", str(root)]) == 0
    index = json.loads((root / INDEX_FILE).read_text())
    assert len(index["weight_map"]) == len(tensors) and index["metadata"]["total_size"] > 0
    assert main(["pack", "index", str(root), "--check"]) == 0
    Pack.open(root)  # vLLM-style loading through the index works
    # drift: a tensor moved to another file, the stale index names the old one
    index["weight_map"]["model.norm.weight"] = "a.safetensors"
    (root / INDEX_FILE).write_text(json.dumps(index))
    capsys.readouterr()
    assert main(["pack", "index", str(root), "--check"]) == 1
    assert "~ model.norm.weight: the index says a.safetensors, it is in b.safetensors" in capsys.readouterr().out
    assert json.loads((root / INDEX_FILE).read_text())["weight_map"]["model.norm.weight"] == "a.safetensors"
    # duplicates: named with both files
    save_file({"model.norm.weight": tensors["model.norm.weight"]}, root / "c.safetensors")
    with pytest.raises(Exl3FormatError, match=r"c\.safetensors tensor 'model\.norm\.weight'.*duplicate also in .*"
                                              r"b\.safetensors"):
        packtools.scan_shards(root)
    assert main(["pack", "index", str(root)]) == 1


def test_config_derives_diffs_and_writes(tmp_path, capsys):
    root = copy_pack(pack_dir(MCG), tmp_path / "p")
    config = json.loads((root / "config.json").read_text())
    qc = config["quantization_config"]
    config["quantization_config"] = {"quant_method": "exl3", "codebook": "mul1", "layer_bits": {"0": 4},
                                     "version": qc["version"]}
    (root / "config.json").write_text(json.dumps(config))
    derived = packtools.derive_config(Pack.open(root).tensors, {}).config
    assert derived["codebook"] == "mcg" and derived["layer_bits"] == {"0": 3, "1": 3}
    assert derived["non_routed_exl3"] == {"modules": ["k_proj", "o_proj", "q_proj", "v_proj"], "bits": 3}
    assert derived["head_bits"] == 6
    assert main(["pack", "config", str(root)]) == 0
    out = capsys.readouterr().out
    assert '-  "codebook": "mul1"' in out and '+  "codebook": "mcg"' in out
    assert json.loads((root / "config.json").read_text())["quantization_config"]["codebook"] == "mul1"  # unchanged
    assert main(["pack", "config", str(root), "--write"]) == 0
    written = json.loads((root / "config.json").read_text())["quantization_config"]
    assert written["codebook"] == "mcg" and written["version"] == qc["version"]
    assert json.loads((root / "quantization_config.json").read_text()) == written  # the sidecar follows
    capsys.readouterr()
    assert main(["pack", "config", str(root)]) == 0
    assert "already matches" in capsys.readouterr().out


@pytest.mark.parametrize("dense_kind", ["exl3", "dequantized"])
def test_overlay(tmp_path, dense_kind):
    experts = copy_pack(pack_dir(MCG), tmp_path / "experts")
    if dense_kind == "exl3":
        dense = copy_pack(pack_dir(MUL1), tmp_path / "dense")
    else:
        dense = dequantized_model(pack_dir(MUL1), tmp_path / "dense")
    out = tmp_path / "out"
    result = packtools.overlay(experts, dense, out)
    pack, problems = verify_pack(out)
    assert not problems
    lin = pack.linears()
    assert lin["model.layers.1.mlp.experts.7.down_proj"].codebook == "mcg"
    qc = pack.quantization_config
    if dense_kind == "exl3":
        assert lin["model.layers.0.self_attn.q_proj"].codebook == "mul1" and "codebook" not in qc
        assert qc["non_routed_exl3"]["bits"] == 4 and result.linked == []
    else:
        assert "model.layers.0.self_attn.q_proj" not in lin and "non_routed_exl3" not in qc
        assert pack.tensors["model.layers.0.self_attn.q_proj.weight"].dtype == "F32"
        assert not any(".experts." in n and n.endswith(".weight") for n in pack.tensors)
        # the dense shard holds no routed experts: linked, not copied (same inode)
        assert result.linked == ["dense-model-00002-of-00002.safetensors"]
        assert os.stat(out / result.linked[0]).st_ino == os.stat(dense / "model-00002-of-00002.safetensors").st_ino
    assert (out / "tokenizer.json").exists() and (out / INDEX_FILE).exists()


def test_overlay_symlinks_and_refuses_bad_inputs(tmp_path, capsys):
    experts = copy_pack(pack_dir(MCG), tmp_path / "experts")
    dense = dequantized_model(pack_dir(MUL1), tmp_path / "dense")
    assert main(["pack", "overlay", str(experts), str(dense), "-o", str(tmp_path / "o"), "--symlink"]) == 0
    assert (tmp_path / "o" / "dense-model-00002-of-00002.safetensors").is_symlink()
    assert main(["pack", "overlay", str(experts), str(dense), "-o", str(tmp_path / "o")]) == 1
    assert "not empty" in capsys.readouterr().err
    # a different model
    glm = copy_pack(pack_dir("glm4moe-a-exl3-mcg-b4"), tmp_path / "glm")
    with pytest.raises(Exl3FormatError, match=r"glm/config\.json: expected num_hidden_layers = 2"):
        packtools.overlay(experts, glm, tmp_path / "o2")
    # an "experts pack" without EXL3 experts
    with pytest.raises(Exl3FormatError, match="EXL3 routed experts"):
        packtools.overlay(dense, experts, tmp_path / "o3")


def test_overlay_of_an_incomplete_dense_source_is_refused(tmp_path, capsys):
    """The overlay that kept 194 of 240 tensors: a dense source without layer 1's attention made a pack that
    `pack overlay` called verified and `serve` answered with empty text. Its check is `verify`'s: refused."""
    experts = copy_pack(pack_dir(MCG), tmp_path / "experts")
    dense = dequantized_model(pack_dir(MUL1), tmp_path / "dense")
    shard = dense / "model-00002-of-00002.safetensors"
    t = load_file(shard)
    save_file({k: v for k, v in t.items() if not k.startswith("model.layers.1.self_attn.")}, shard,
              metadata={"format": "pt"})
    packtools.write_index(dense, *packtools.scan_shards(dense))
    assert main(["pack", "overlay", str(experts), str(dense), "-o", str(tmp_path / "out")]) == 1
    err = " ".join(capsys.readouterr().err.split())
    assert "tensor 'model.layers.1.self_attn.q_proj': expected an EXL3 linear" in err and "verified" not in err


def test_verify_deep_passes_the_fixture_and_names_a_bad_tensor(tmp_path, capsys):
    root = copy_pack(pack_dir(MCG), tmp_path / "p")
    assert main(["verify", "--deep", str(root)]) == 0
    out = capsys.readouterr().out
    assert "ok   exl3  model.layers.0.mlp.experts.0.gate_proj" in out and "ok   plain model.norm.weight" in out
    t = load_file(root / "model.safetensors")
    t["model.layers.1.self_attn.o_proj.svh"][3] = float("nan")
    t["model.norm.weight"][0] = float("inf")
    save_file(t, root / "model.safetensors")
    checks = deep.deep_verify(Pack.open(root))
    bad = {c.name: str(c.problem) for c in checks if c.problem}
    assert set(bad) == {"model.layers.1.self_attn.o_proj", "model.norm.weight"}
    assert "tensor 'model.layers.1.self_attn.o_proj.svh': expected finite scales, found 1 NaN/inf" in \
        bad["model.layers.1.self_attn.o_proj"]
    assert main(["verify", "--deep", str(root)]) == 1
    # the plain checks already refuse a non-finite svh, before the deep pass decodes anything
    assert "scales, found 1 NaN or Inf" in " ".join(capsys.readouterr().err.split())


def test_verify_deep_insane_scale(tmp_path):
    root = copy_pack(pack_dir(MCG), tmp_path / "p")
    t = load_file(root / "model.safetensors")
    t["model.layers.0.self_attn.q_proj.suh"] = torch.full_like(t["model.layers.0.self_attn.q_proj.suh"], 6e4)
    save_file(t, root / "model.safetensors")
    [c] = [c for c in deep.deep_verify(Pack.open(root)) if c.problem]
    assert "scales of magnitude <= 10000" in str(c.problem)
