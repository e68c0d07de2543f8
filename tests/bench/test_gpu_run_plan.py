"""bench/gpu/run.py reads bench/gpu/plan.toml: the bars on vLLM's own weights get their config from the shape (no
16 GB pack written for a config) unless the pack's depth depends on the disk, and a boot group keeps plan order."""

from __future__ import annotations

import importlib.util
import json
import random
import subprocess
import sys
import time
import tomllib
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
GPU = ROOT / "bench" / "gpu"


@pytest.fixture
def run(tmp_path, monkeypatch):
    monkeypatch.setenv("VGPU_RUN_DIR", str(tmp_path / "work"))
    monkeypatch.setenv("OUT", str(tmp_path / "out"))
    monkeypatch.syspath_prepend(str(GPU))
    spec = importlib.util.spec_from_file_location("gpu_run", GPU / "run.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    yield module
    sys.modules.pop("packs", None)


@pytest.fixture
def plan():
    return tomllib.loads((GPU / "plan.toml").read_text())


def serve_row(plan, label):
    return next(e for e in plan["serve"] if e["label"] == label)


def test_a_fixed_depth_bar_needs_no_pack_written(run, plan):
    assert run.pack_needed(plan, serve_row(plan, "fp16-vllm")) is None
    assert run.pack_needed(plan, serve_row(plan, "gptq-4b-vllm")) is None
    # GLM's pack holds as many layers as the disk allows: its GPTQ bar must have the same depth
    assert run.pack_needed(plan, serve_row(plan, "glm-gptq-4b-vllm")) == "glm-4.5-air-4b"
    assert run.pack_needed(plan, serve_row(plan, "exl3-4b-native")) == "qwen3-30b-a3b-4b"  # its own pack


def test_config_from_the_shape(run, plan):
    import packs

    folder, load_format = run.model_dir(plan, serve_row(plan, "fp16-vllm"))
    config = json.loads((folder / "config.json").read_text())
    shape = packs.SHAPES["qwen3-30b-a3b"]
    assert load_format == "dummy"
    assert config["num_hidden_layers"] == shape.layers == 48
    assert config["hidden_size"] == shape.hidden and config["num_experts"] == shape.experts
    assert "quantization_config" not in config  # fp16: vLLM's own unquantized MoE
    assert json.loads((folder / "tokenizer.json").read_text())["model"]["type"] == "WordLevel"

    folder, _ = run.model_dir(plan, serve_row(plan, "gptq-4b-vllm"))
    gptq = json.loads((folder / "config.json").read_text())
    assert gptq["quantization_config"] == {"quant_method": "gptq", "bits": 4, "group_size": 128, "sym": True,
                                           "desc_act": False}
    assert {k: v for k, v in gptq.items() if k != "quantization_config"} == \
        {k: v for k, v in config.items() if k != "quantization_config"}


def test_a_written_pack_gives_its_own_config(run, plan):
    """When the pack is there its config wins (a pack of fewer layers than the shape keeps the bar at its depth)."""
    pack = run.pack_dir("qwen3-30b-a3b-4b")
    pack.mkdir(parents=True)
    (pack / "config.json").write_text(json.dumps({"num_hidden_layers": 3, "quantization_config": {"x": 1}}))
    (pack / "tokenizer.json").write_text("{}")
    (pack / "tokenizer_config.json").write_text("{}")
    (pack / "done.json").write_text("{}")
    folder, _ = run.model_dir(plan, serve_row(plan, "fp16-vllm"))
    assert json.loads((folder / "config.json").read_text()) == {"num_hidden_layers": 3}


def test_boot_groups_keep_plan_order(run, plan):
    groups = run.boot_groups([serve_row(plan, label) for label in
                              ("exl3-4b-native", "exl3-2b-exllamav3", "gptq-4b-vllm", "exl3-2b-native")])
    assert [[e["label"] for e in g] for g in groups] == [["exl3-4b-native", "gptq-4b-vllm"],
                                                         ["exl3-2b-exllamav3", "exl3-2b-native"]]


def test_exlgen_reports_each_plan_pack_it_could_not_run(run, plan, monkeypatch):
    """Every [exlgen] pack gets a result row; one whose pack was never written says so instead of being skipped."""
    run.RESULTS.mkdir(parents=True)
    monkeypatch.setattr(run, "exl_ready", lambda build, wait_s=0: True)
    run.exlgen(plan, None)
    rows = {p: json.loads((run.RESULTS / f"exlgen-{p}.json").read_text()) for p in plan["exlgen"]["packs"]}
    assert set(rows) == {"qwen3-30b-a3b-4b", "qwen3-30b-a3b-2b"}
    assert all(r["error"] == "pack not written (see packs.log)" for r in rows.values())


def test_the_families_step_names_packs_the_repository_has(run, plan):
    """Every [families] pack is a fixture with goldens, every oracle one a family dev/family_oracle.py makes, and
    every per-pack setting names one of them: a typo would cost a device call."""
    from vllm_exl3.dev import family_oracle

    f = plan["families"]
    for name in f["packs"]:
        assert (run.FAMILY_FIXTURES / name / "golden" / "logits.safetensors").is_file(), name
    assert set(f["oracle"]) <= set(family_oracle.ORACLE_ARCHITECTURES)
    assert set(f.get("per-pack", {})) <= set(f["packs"]) | set(f["oracle"])
    for name, v in f.get("variants", {}).items():
        assert (run.FAMILY_FIXTURES / v["pack"] / "golden" / "logits.safetensors").is_file(), name
    assert set(f.get("unquantized", [])) <= set(f["oracle"])  # a control is made from an oracle pack
    assert f["round-size"] >= 1 and 0 <= f["min-top2-margin"] < 0.05


def test_the_families_step_reports_missing_oracle_packs(run, plan, monkeypatch, tmp_path):
    """Without bench/gpu/oracle_packs.py's folder the step says which packs it lacks and boots none of them."""
    monkeypatch.setattr(run, "ORACLE", tmp_path / "none")
    plan["families"]["packs"], plan["families"]["variants"] = [], {}
    plan["quality"]["kernels"] = ["native"]
    run.families(plan, None)
    got = json.loads((run.RESULTS / "families.json").read_text())
    assert got["missing"]["ok"] is False and "GptOssForCausalLM" in got["missing"]["error"]
    assert [k for k in got if k.startswith("native-")] == []


def test_a_pack_with_an_unquantized_control_is_held_to_the_controls_top1(run):
    """gpt-oss in bf16: vLLM's own layers land under the fixed 0.97, so the plugin's rows are judged against them
    (less the plan's slack); the median bound still applies, and rows of other families keep their verdict."""
    results = {
        "vllm-unquantized-GptOssForCausalLM": {"ok": False, "top1_agreement": 0.95, "positions": 80,
                                               "median_abs_logprob_delta": 5.5e-3},
        "native-GptOssForCausalLM": {"ok": False, "top1_agreement": 0.925, "median_abs_logprob_delta": 5.5e-3},
        "exllamav3-GptOssForCausalLM": {"ok": False, "top1_agreement": 0.9, "median_abs_logprob_delta": 4.5e-3},
        "torch-GptOssForCausalLM": {"ok": False, "top1_agreement": 1.0, "median_abs_logprob_delta": 0.07},
        "native-Qwen3NextForCausalLM": {"ok": False, "top1_agreement": 0.95, "median_abs_logprob_delta": 1e-3},
        "exllamav3-Qwen3_5MoeForCausalLM": {"ok": False, "error": "not healthy: exited (1) while booting"},
    }
    run.against_controls(results, 2, 0.05)
    assert results["native-GptOssForCausalLM"]["ok"] is True  # 0.925 >= 0.95 - 2/80
    assert results["native-GptOssForCausalLM"]["min_top1"] == pytest.approx(0.925)
    assert results["exllamav3-GptOssForCausalLM"]["ok"] is False  # three positions under
    assert results["torch-GptOssForCausalLM"]["ok"] is False  # the median bound stands
    qwen = results["native-Qwen3NextForCausalLM"]
    assert qwen["ok"] is False and "min_top1" not in qwen  # no control: its verdict stays
    assert results["exllamav3-Qwen3_5MoeForCausalLM"] == {"ok": False, "error": "not healthy: exited (1) while booting"}
    assert results["vllm-unquantized-GptOssForCausalLM"]["ok"] is False  # the control reports the fixed bound


@pytest.mark.parametrize("shape_name", ["qwen3-30b-a3b", "glm-4.5-air", "qwen3-next-80b-a3b"])
def test_the_benchmark_packs_are_complete_for_their_family(run, tmp_path, shape_name):
    """bench/gpu/packs.py writes every tensor the plugin's table for the family expects and no other (the same
    check `vllm-exl3 verify` makes): at the shape's own widths, with 4 experts instead of hundreds so the pack is
    small, and 4 layers (Qwen3-Next: three delta nets, then gated attention)."""
    import dataclasses

    import packs
    from vllm_exl3.dev.synthetic import write_pack
    from vllm_exl3.format.pack import verify_pack

    shape = dataclasses.replace(packs.SHAPES[shape_name], experts=4, top_k=2, vocab=512)
    tensors = packs.outer_tensors(shape, "mcg")
    for layer in range(4):
        tensors.update(packs.layer_tensors(shape, layer, 2, "mcg"))
    root = write_pack(tmp_path / "pack", tensors, packs.config_json(shape, 4, 2, "mcg"))
    pack, problems = verify_pack(root)
    assert problems == []
    assert any(n.startswith("complete for ") for n in pack.notes), pack.notes


def test_a_families_variant_boots_its_pack_under_its_own_label_and_settings(run, plan, monkeypatch):
    """[families.variants.NAME] serves a fixture pack once more beside the plain row, with its own flags and env
    (the compiled-against-eager A/B of bench/notes/serving-run-13.md); a variant of a pack that is not there is
    reported missing and not booted."""
    booted = []
    monkeypatch.setattr(run, "run_round", lambda plan, boots, *a, **k: booted.extend(boots))
    f = plan["families"]
    pack = f["packs"][0]
    f["oracle"], f["unquantized"] = [], []
    f["variants"] = {f"{pack}-eager": {"pack": pack, "flags": ["--enforce-eager"], "env": {"X": "1"}},
                     "absent-eager": {"pack": "no-such-pack", "flags": ["--enforce-eager"]}}
    plan["quality"]["kernels"] = ["native"]
    run.families(plan, None)
    rows = {label: (path.name, setting) for label, path, kernel, cache, setting in booted}
    assert rows[f"native-{pack}"][0] == pack
    assert rows[f"native-{pack}-eager"] == (pack, f["variants"][f"{pack}-eager"])
    assert "native-absent-eager" not in rows
    got = json.loads((run.RESULTS / "families.json").read_text())
    assert "no-such-pack" in got["missing"]["error"] and pack not in got["missing"]["error"]


def test_the_spec_step_compares_greedy_tokens_and_names_where_they_part(run, plan):
    """The spec step's verdict: the drafted server's greedy tokens equal the plain server's, prompt for prompt; where
    they part, the position and the plain server's top-two gap there are reported (a near-tie that fp16 may break
    either way reads differently from a lost token)."""
    plain = [{"tokens": [5, 6, 7], "top2_gaps": [0.5, 0.25, 0.125]}, {"tokens": [1, 2], "top2_gaps": [1.0, 0.001]}]
    assert run.compare_greedy(plain, [dict(p) for p in plain]) == {"equal": True, "parts": [], "tokens": 5}
    drafted = [plain[0], {"tokens": [1, 3], "top2_gaps": [1.0, 2.0]}]
    assert run.compare_greedy(plain, drafted) == {
        "equal": False, "parts": [{"prompt": 1, "position": 1, "plain_top2_gap": 0.001}], "tokens": 5}
    assert run.compare_greedy(plain, plain[:1])["equal"] is False  # a prompt left out is no agreement
    assert run.top2_gap({"a": -0.1, "b": -2.6, "c": -3.0}) == 2.5 and run.top2_gap({"a": -0.1}) is None


def test_every_spec_case_names_a_fixture_pack_and_a_method(plan):
    fixtures = ROOT / "tests" / "fixtures" / "exl3"
    cases = plan["spec"]["case"]
    assert {c["speculative-config"]["method"] for c in cases} == {"ngram", "mtp", "eagle3"}
    for c in cases:
        assert (fixtures / c["pack"] / "golden").is_dir(), c["pack"]
        assert c["speculative-config"]["method"] != "mtp" or c.get("mtp-layer"), c  # no fixture stores MTP layers
        assert c["speculative-config"]["method"] != "eagle3" or c.get("eagle3-head"), c


def test_spec_cases_of_one_pack_share_its_plain_server(run, plan):
    """Each served pack boots one plain server, whatever number of methods draft on it; an MTP-layer case serves
    its own pack (the fixture with the layer appended), plain and drafted."""
    plain, drafted = run.spec_servings(plan["spec"]["case"])
    assert plain == {"qwen3moe-a-exl3-mul1-b4": {"pack": "qwen3moe-a-exl3-mul1-b4", "mtp-layer": False},
                     "glm4moe-a-exl3-mcg-b4-mtp": {"pack": "glm4moe-a-exl3-mcg-b4", "mtp-layer": True}}
    assert [(served, name) for served, name, _ in drafted] == [
        ("qwen3moe-a-exl3-mul1-b4", "qwen3moe-a-exl3-mul1-b4-ngram"),
        ("qwen3moe-a-exl3-mul1-b4", "qwen3moe-a-exl3-mul1-b4-eagle3"),
        ("glm4moe-a-exl3-mcg-b4-mtp", "glm4moe-a-exl3-mcg-b4-mtp-mtp")]


def _tool_families() -> set[str]:
    """tools/exl3-packs/families.py's ARGS keys, read without importing it (its import opens the tool's log)."""
    import ast

    tree = ast.parse((ROOT / "tools" / "exl3-packs" / "families.py").read_text())
    node = next(n for n in tree.body if isinstance(n, ast.Assign) and getattr(n.targets[0], "id", "") == "ARGS")
    return {k.value for k in node.value.keys}


def test_the_heldout_step_asks_the_tool_for_families_it_makes(plan):
    for entry in plan["heldout"]["make"]:
        assert set(entry["families"]) <= _tool_families(), entry
        assert entry["variants"] and set(entry["variants"]) <= {"a", "b"}, entry


def _pack(root: Path, name: str, config: dict, files: dict[str, int] | None = None) -> Path:
    pack = root / name
    (pack / "golden").mkdir(parents=True)
    (pack / "config.json").write_text(json.dumps(config))
    rng = random.Random(name)  # incompressible, as trellis words are
    for rel, size in {"golden/logits.safetensors": 64, **(files or {})}.items():
        (pack / rel).write_bytes(rng.randbytes(size))
    return pack


def test_a_heldout_pack_gets_its_names_or_its_architectures_settings(run, plan, tmp_path):
    """heldout.setting: the pack's own [families.per-pack] entry, else its architecture's (the oracle packs'); an
    MLA latent other than 576 adds vLLM's per-head attention, whatever else applies."""
    per_pack = plan["families"]["per-pack"]
    nxt = _pack(tmp_path, "qwen3next-b-exl3-mcg-b3", {"architectures": ["Qwen3NextForCausalLM"]})
    assert run.heldout.setting(per_pack, nxt) == per_pack["Qwen3NextForCausalLM"]
    oss = _pack(tmp_path, "gptoss-b-exl3-mul1-b3", {"architectures": ["GptOssForCausalLM"]})
    assert run.heldout.setting(per_pack, oss)["flags"] == ["--dtype", "bfloat16"]
    mla = {"architectures": ["Glm4MoeLiteForCausalLM"], "kv_lora_rank": 128, "qk_rope_head_dim": 32}
    assert run.heldout.setting(per_pack, _pack(tmp_path, "glm-b", mla)) == {"env": {"VLLM_MLA_DISABLE": "1"}}
    real = {**mla, "kv_lora_rank": 512, "qk_rope_head_dim": 64}
    assert run.heldout.setting(per_pack, _pack(tmp_path, "glm-real", real)) == {}
    mixtral = _pack(tmp_path, "mixtral-b", {"architectures": ["MixtralForCausalLM"]})
    assert run.heldout.setting({"mixtral-b": {"env": {"X": "1"}}}, mixtral) == {"env": {"X": "1"}}


def test_the_families_step_serves_the_packs_the_heldout_step_made(run, plan, monkeypatch):
    """With [families] heldout, every pack the heldout step finished (goldens written) boots on each profile under
    its own name with heldout.setting's settings; an unfinished one does not."""
    booted = []
    monkeypatch.setattr(run, "run_round", lambda plan, boots, *a, **k: booted.extend(boots))
    f = plan["families"]
    f["packs"], f["oracle"], f["unquantized"], f["variants"] = [], [], [], {}
    arch = run.HELDOUT / "work" / "arch"
    _pack(arch / "b", "qwen35moe-b-exl3-mcg-b4", {"architectures": ["Qwen3_5MoeForCausalLM"]})
    _pack(arch / "a", "ernie45moe-a-exl3-mul1-b4", {"architectures": ["Ernie4_5_MoeForCausalLM"]})
    (arch / "b" / "mixtral-b-exl3-3inst-b2.5").mkdir()  # converted, goldens not written
    plan["quality"]["kernels"] = ["native", "exllamav3"]
    monkeypatch.setattr(run, "exl_ready", lambda build, wait=0: True)
    run.families(plan, None)
    rows = {label: (path, setting) for label, path, kernel, cache, setting in booted}
    assert sorted(rows) == ["exllamav3-ernie45moe-a-exl3-mul1-b4", "exllamav3-qwen35moe-b-exl3-mcg-b4",
                            "native-ernie45moe-a-exl3-mul1-b4", "native-qwen35moe-b-exl3-mcg-b4"]
    assert rows["native-qwen35moe-b-exl3-mcg-b4"] == (arch / "b" / "qwen35moe-b-exl3-mcg-b4",
                                                      f["per-pack"]["Qwen3_5MoeForCausalLM"])
    assert rows["native-ernie45moe-a-exl3-mul1-b4"][1] == {}


def test_heldout_archives_keep_within_the_device_tools_limits(run, tmp_path, monkeypatch):
    """heldout.export: packs grouped into archives of at most PART_BYTES, MAX_PARTS of them, the reconstructed
    weights left out, the packs named first archived first; what does not fit is named, not dropped silently."""
    monkeypatch.setattr(run.heldout, "PART_BYTES", 6000)
    monkeypatch.setattr(run.heldout, "MAX_PARTS", 2)
    src = tmp_path / "packs"
    made = [_pack(src, name, {"architectures": ["X"]}, {"model.safetensors": 2500, "golden/recon_full.safetensors": 9000})
            for name in ("mixtral-b", "minimaxm2-b", "gptoss-a", "qwen3next-b", "ernie45moe-a")]
    parts, left_out = run.heldout.export(made, tmp_path / "out", first=("ernie45moe-a", "gptoss-a"))
    assert len(parts) == 2 and all(p.stat().st_size <= 6000 for p in parts)
    import tarfile

    names = [[m.name for m in tarfile.open(p).getmembers() if m.isfile()] for p in parts]
    assert {n.split("/")[0] for n in names[0]} == {"ernie45moe-a", "gptoss-a"}
    assert not any("recon_" in n for part in names for n in part)
    archived = {n.split("/")[0] for part in names for n in part}
    assert archived | set(left_out) == {p.name for p in made} and not archived & set(left_out)


def test_a_server_captures_the_plans_graph_sizes_unless_its_row_names_its_own(run, plan, monkeypatch):
    """[server] capture-sizes reach `vllm serve` as --compilation-config's cudagraph_capture_sizes (every batch of
    1-8 sequences: no padded 3- or 5-row steps), once; a row's empty list passes none, so vLLM captures its own."""
    started = []

    class Recorder:
        def __init__(self, label, model, flags, env, cache):
            started.append(flags)
            self.argv = ["python", "-m", "vllm", *flags]

    monkeypatch.setattr(run, "Server", Recorder)
    pack = run.pack_dir("qwen3-30b-a3b-4b")  # the written pack the EXL3 row serves
    pack.mkdir(parents=True)
    for name in ("config.json", "tokenizer.json", "tokenizer_config.json", "done.json"):
        (pack / name).write_text("{}")
    run.start_server(plan, serve_row(plan, "gptq-4b-vllm"))
    run.start_server(plan, serve_row(plan, "exl3-4b-native-default-graphs"))
    planned, default = started
    assert planned.count("--compilation-config") == 1
    sizes = json.loads(planned[planned.index("--compilation-config") + 1])["cudagraph_capture_sizes"]
    assert sizes[:8] == list(range(1, 9)) and sizes == plan["server"]["capture-sizes"]
    assert "--compilation-config" not in default


def test_a_server_that_did_not_come_up_says_whether_it_exited_or_was_still_booting(run):
    """The nineteenth run's exllamav3 Qwen3-Next row read "not healthy" while its log ended mid-boot (its round's
    wait had run out): the row names the two cases apart."""
    s = object.__new__(run.Server)
    s.t0 = time.monotonic()
    s.proc = subprocess.Popen([sys.executable, "-c", "raise SystemExit(3)"])
    s.proc.wait()
    assert s.unhealthy() == "not healthy: exited (3) while booting"
    s.proc = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(30)"])
    try:
        assert s.unhealthy().startswith("not healthy: still booting when its wait ended, ")
    finally:
        s.proc.kill()
        s.proc.wait()
