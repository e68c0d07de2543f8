"""A speculative method the pack or the environment cannot serve is refused before the boot, in `vllm-exl3 serve`
and the launcher's preflight alike, with one message naming the pack and what is missing.

Without the check, vLLM takes minutes to fail or does not fail at all: `mtp` on the GLM-4.7-Flash fixture (no
num_nextn_predict_layers) crashes vLLM's worker with an AttributeError; on a pack whose config declares MTP layers
it does not store, vLLM's drafter would load with random weights and accept nothing; `suffix` without
arctic-inference stops vLLM's API server with an ImportError. The lossless n-gram and mtp serving tests are in
tests/e2e/test_speculative_e2e.py."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest
from support import qwen3_vl
from support.mutants import copy_pack, edit_json, entries, rebuild, run_cli
from support.servers import free_port
from vllm_exl3 import demo
from vllm_exl3.appliance.preflight import check_speculative
from vllm_exl3.format.pack import Pack

FAMILIES = Path(__file__).resolve().parents[1] / "fixtures" / "exl3-families"
GLM_LITE, QWEN35 = FAMILIES / "glm4moelite-a-exl3-mcg-b4", FAMILIES / "qwen35moe-a-exl3-mul1-b3.5"
ST = "model.safetensors"
MTP = {"method": "mtp", "num_speculative_tokens": 1}
PARSE_S = 180  # these commands ask vLLM's own parser (a child process importing vLLM): seconds on a busy box


def spec_args(config: dict) -> list[str]:
    return ["--", "--speculative-config", json.dumps(config)]


def add_tensors(root: Path, names: list[str], shape=(256,)) -> None:
    """Plain BF16 tensors (zeros): the check reads names, never values."""
    t = entries(root / ST)
    for name in names:
        t[name] = ("BF16", list(shape), bytes(2 * shape[0]))
    rebuild(root / ST, t)


def test_serve_refuses_mtp_for_an_architecture_without_mtp_layers():
    code, err = run_cli("serve", "--demo", "--once", "--port", str(free_port()), *spec_args(MTP), seconds=PARSE_S)
    assert code == 2, err
    assert "refusing to serve: --speculative-config asks for method 'mtp'" in err, err
    assert f"{demo.PACK} (Qwen3MoeForCausalLM) has none: the plugin knows no MTP layers for this architecture" in err
    assert "Method 'ngram' needs no draft weights" in err


def test_preflight_refuses_mtp_on_a_pack_whose_config_declares_none():
    """The GLM-4.7-Flash fixture: vLLM's worker crashes on it (no num_nextn_predict_layers); refused in seconds."""
    code, err = run_cli("preflight", str(GLM_LITE), *spec_args({**MTP, "method": "glm4_moe_lite_mtp"}), seconds=PARSE_S)
    assert code == 78, err
    assert "FAIL speculative: --speculative-config asks for method 'glm4_moe_lite_mtp'" in err, err
    assert "its config declares no MTP layer (num_nextn_predict_layers = None)" in err


@pytest.mark.parametrize("source,declare,stored,missing", [
    (GLM_LITE, {"num_nextn_predict_layers": 1}, ["model.layers.3.eh_proj.weight", "model.layers.3.enorm.weight",
                                                 "model.layers.3.hnorm.weight"],
     "it stores no MTP layer: no model.layers.3 holding eh_proj, enorm, hnorm (the converter left them out)"),
    (QWEN35, {"mtp_num_hidden_layers": 1}, ["mtp.fc.weight", "mtp.norm.weight"],
     "it stores no MTP tensors: none under mtp.* (the converter left them out)"),
], ids=["glm-layers-after-the-last", "qwen3.5-mtp-prefix"])
def test_mtp_needs_the_layers_the_config_declares_stored(tmp_path, source, declare, stored, missing):
    """The family tables (format/families/) say where each family keeps its MTP layers: a config that declares
    them is not enough, and a pack that stores them passes the check (and verifies complete)."""
    root = copy_pack(source, tmp_path / "declared")
    edit_json(root / "config.json", lambda c: c.update(declare))
    check = check_speculative(Pack.open(root), MTP)
    assert not check.ok and missing in check.detail, check.detail
    add_tensors(root, stored)
    pack = Pack.open(root)
    assert check_speculative(pack, MTP).ok
    assert pack.problems() == [], pack.problems()


def test_serve_refuses_suffix_without_arctic_inference():
    if importlib.util.find_spec("arctic_inference") is not None:
        pytest.skip("arctic-inference is installed here")
    code, err = run_cli("serve", "--demo", "--once", "--port", str(free_port()),
                        *spec_args({"method": "suffix", "num_speculative_tokens": 3}), seconds=PARSE_S)
    assert code == 2 and "method 'suffix', which needs the arctic-inference package" in err, err


def test_ngram_and_no_speculation_pass(tmp_path):
    pack = Pack.open(demo.PACK)
    assert check_speculative(pack, None) is None
    check = check_speculative(pack, {"method": "ngram", "num_speculative_tokens": 3})
    assert check.ok and check.detail == "method ngram, 3 draft token(s) a step"


def test_the_spec_mtp_preset_is_refused_for_a_pack_without_mtp_layers_and_planned_for_one_with(tmp_path, monkeypatch):
    """`PRESET=spec-mtp` in the appliance's .env reaches the launcher as VLLM_EXL3_PRESET (docker-compose.yml):
    on the demo pack (Qwen3-MoE, no MTP layers) preflight refuses before the boot; on a Qwen3.5 pack that stores
    its `mtp.` module the memory plan counts the MTP layer (appliance/memory_plan.py)."""
    monkeypatch.setenv("VLLM_EXL3_PRESET", "spec-mtp")
    code, err = run_cli("preflight", str(demo.PACK), seconds=PARSE_S)
    assert code == 78, err
    assert "preset spec-mtp" in err and "FAIL speculative: --speculative-config asks for method 'mtp'" in err, err
    assert "has none: the plugin knows no MTP layers for this architecture" in err

    root = copy_pack(QWEN35, tmp_path / "qwen35")
    edit_json(root / "config.json", lambda c: c.update(mtp_num_hidden_layers=1))
    add_tensors(root, ["mtp.fc.weight", "mtp.norm.weight"])
    meminfo = tmp_path / "meminfo"  # an idle Spark
    meminfo.write_text("MemTotal:       125000000 kB\nMemFree:        118000000 kB\nMemAvailable:   120000000 kB\n")
    # vLLM inspects the architecture in a child process, which imports Qwen3.5's modules
    monkeypatch.setenv("PYTHONPATH", qwen3_vl.pythonpath())
    code, err = run_cli("preflight", str(root), "--meminfo", str(meminfo), seconds=PARSE_S)
    assert code == 0, err
    assert "ok   speculative: method mtp, 1 draft token(s) a step" in err, err
    assert "mtp drafts: 1 MTP layer(s)" in err, err


# ---------------------------------------------------------------------------------------------------------------
# eagle3 / eagle: a separate bf16 draft head (dev/eagle3.py writes one for a pack; served in
# tests/e2e/test_speculative_e2e.py)
# ---------------------------------------------------------------------------------------------------------------
GLM = Path(__file__).resolve().parents[1] / "fixtures" / "exl3" / "glm4moe-a-exl3-mcg-b4"


@pytest.fixture(scope="module")
def demo_head(tmp_path_factory):
    from vllm_exl3.dev import eagle3

    return eagle3.write_head(demo.PACK, tmp_path_factory.mktemp("eagle3") / "head")


def eagle3_config(head, **more) -> dict:
    return {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2, **more}


def test_a_head_made_for_the_pack_passes(demo_head):
    check = check_speculative(Pack.open(demo.PACK), eagle3_config(demo_head), eagle3_target=True)
    assert check.ok and check.detail == "method eagle3, 2 draft token(s) a step", check.detail


@pytest.mark.parametrize("change,expected", [
    (lambda head: {"model": None}, ("no 'model' (the draft head's directory) in the speculative config. Give "
                                    "'model' the directory of a bf16 EAGLE head trained for this model")),
    (lambda head: {"model": str(head / "config.json")}, "config.json is not a directory (a local EAGLE head"),
    (lambda head: {"model": str(head.parent)}, "{parent}/config.json does not exist"),
    (lambda head: {"quantization": "exl3"}, "the head is to be served as EXL3"),
], ids=["no-model", "a-file", "no-config", "asked-as-exl3"])
def test_a_head_that_is_not_there_or_asked_as_exl3_is_refused(demo_head, change, expected):
    check = check_speculative(Pack.open(demo.PACK), eagle3_config(demo_head, **change(demo_head)))
    expected = expected.replace("{parent}", str(demo_head.parent))
    assert not check.ok and "--speculative-config asks for method 'eagle3', a separate draft head, but" in check.detail
    assert expected in check.detail, check.detail


@pytest.mark.parametrize("edit,expected", [
    ({"target_hidden_size": 512}, ("has target_hidden_size 512 (hidden_size 256), and {pack} (Qwen3MoeForCausalLM) "
                                   "has hidden_size 256: the head was made for another model")),
    ({"eagle_aux_hidden_state_layer_ids": [1, 20, 40]},
     ("reads the target's hidden states after layers [1, 20, 40] (its eagle_aux_hidden_state_layer_ids, as a vLLM "
      "model runner reads them, or vLLM's default when absent), and {pack} has 2 layers: ids must be distinct, "
      "within 0..2; name them at the top level")),
    ({"eagle_aux_hidden_state_layer_ids": [1, 1, 2]}, "after layers [1, 1, 2]"),
    ({"eagle_aux_hidden_state_layer_ids": None}, "after layers [2, 1, -1]"),  # vLLM's default, 2 layers
    # Ids only inside eagle_config: vLLM 0.32's runner reads them there, 0.33's GPU runner reads `layer_ids` there
    # and otherwise takes the model's default, which this 2-layer target lacks (what an H100 run showed).
    ({"eagle_aux_hidden_state_layer_ids": None, "eagle_config": {"eagle_aux_hidden_state_layer_ids": [0, 1, 2]}},
     "after layers [2, 1, -1]"),
    ({"quantization_config": {"quant_method": "exl3", "bits": 4.0}}, "quantization_config 'exl3'"),
], ids=["other-width", "layers-the-pack-lacks", "a-layer-twice", "vllms-default-layers", "ids-in-eagle-config-only",
        "an-exl3-head"])
def test_a_head_made_for_another_model_is_refused_naming_its_config(demo_head, tmp_path, edit, expected):
    import shutil

    head = Path(shutil.copytree(demo_head, tmp_path / "head"))
    edit_json(head / "config.json", lambda c: c.update(edit))
    check = check_speculative(Pack.open(demo.PACK), eagle3_config(head))
    assert not check.ok and str(head / "config.json") in check.detail, check.detail
    assert expected.replace("{pack}", str(demo.PACK)) in check.detail, check.detail


def test_eagle3_support_of_the_target_class_is_read_from_vllms_registry(demo_head):
    """vLLM's Qwen3-MoE class implements SupportsEagle3, its GLM-4.5 class does not (its model runner would stop
    the boot with a RuntimeError once the weights are loaded): vLLM's own registry says so, through the options'
    parser (a child process that imports the class's module)."""
    from vllm_exl3.appliance.vllm_options import read_options

    spec = ["--speculative-config", json.dumps(eagle3_config(demo_head))]
    assert read_options(str(demo.PACK), spec).eagle3_target is True
    glm = read_options(str(GLM), spec)
    assert glm.eagle3_target is False
    # Asked only for eagle3: no other method imports the model class's module (checked without a parser child).
    from vllm_exl3.integration.vllm_cli import _eagle3_target
    assert _eagle3_target(object(), MTP) is None and _eagle3_target(object(), None) is None
    check = check_speculative(Pack.open(GLM), eagle3_config(demo_head, model=None), eagle3_target=False)
    assert "no 'model'" in check.detail  # the head's own problems come first
    # A head of GLM's width (dev/eagle3.py reads the pack's geometry) passes everything else, and is refused:
    check = check_speculative(Pack.open(GLM), eagle3_config(demo_head), eagle3_target=glm.eagle3_target)
    assert not check.ok and "vLLM has no EAGLE-3 support for" in check.detail \
        and "architecture Glm4MoeForCausalLM (its model class does not implement SupportsEagle3" in check.detail, \
        check.detail


def test_serve_refuses_a_head_of_another_width_before_the_boot(demo_head, tmp_path):
    import shutil

    head = Path(shutil.copytree(demo_head, tmp_path / "head"))
    edit_json(head / "config.json", lambda c: c.update(hidden_size=512, target_hidden_size=512))
    code, err = run_cli("serve", "--demo", "--once", "--port", str(free_port()), *spec_args(eagle3_config(head)),
                        seconds=PARSE_S)
    assert code == 2, err
    assert "refusing to serve: --speculative-config asks for method 'eagle3', a separate draft head, but " \
           f"{head / 'config.json'} has target_hidden_size 512" in err, err
