"""The families as data (format/family.py, format/families/): each architecture in one family; the config values a
family's model reads are refused by name when absent, mistyped or out of range, and a key asking for math the plugin
does not compute is refused; on the fixture packs, through the same `Pack.problems` every gate asks."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest

from vllm_exl3.format.families import ARCHITECTURES, FAMILIES, family_of
from vllm_exl3.format.family import MATH_KEYS
from vllm_exl3.format.pack import Pack

FAMILIES_DIR = Path(__file__).resolve().parents[1] / "fixtures" / "exl3-families"
FAMILY_PACKS = sorted(p.name for p in FAMILIES_DIR.iterdir() if (p / "golden").is_dir())
PATH = Path("config.json")


def test_every_architecture_is_in_one_family():
    seen = [a for f in FAMILIES for a in f.architectures]
    assert len(seen) == len(set(seen)) == len(ARCHITECTURES)
    assert all(family_of(a).architectures[a] is ARCHITECTURES[a] for a in seen)
    assert family_of("NoSuchForCausalLM") is None


def test_every_moe_family_names_packs_users_download():
    moe = [f for f in FAMILIES if any(t.expert for t in f.architectures.values())]
    assert len(moe) == 9 and all(f.examples for f in moe)


def _problems(architecture: str, config: dict) -> list[str]:
    return [str(p) for p in family_of(architecture).config_problems(config, PATH)]


@pytest.mark.parametrize("architecture, key, reader", [
    ("MiniMaxM2ForCausalLM", "rotary_dim", "vLLM's MiniMaxM2 attention (partial rotary)"),
    ("MiniMaxM2ForCausalLM", "scoring_func", "vLLM's MiniMaxM2 router"),
    ("Glm4MoeLiteForCausalLM", "first_k_dense_replace", "vLLM's Glm4MoeLite"),
    ("Glm4MoeLiteForCausalLM", "kv_lora_rank", "vLLM's MLA attention"),
    ("Qwen3NextForCausalLM", "linear_num_value_heads", "vLLM's gated delta net"),
    ("GptOssForCausalLM", "sliding_window", "vLLM's GptOss attention"),
])
def test_a_value_the_model_reads_with_no_default_is_required(architecture, key, reader):
    config = _minimal(architecture)
    assert _problems(architecture, config) == []
    del config[key]
    [problem] = _problems(architecture, config)
    assert f"expected {key}, which {reader} reads with no default" in problem


@pytest.mark.parametrize("types, says", [
    (["dense", "sparse", "sparse"], 'has 1 leading dense layer: add "first_k_dense_replace": 1'),
    (["dense", "dense", "sparse"], 'has 2 leading dense layers: add "first_k_dense_replace": 2'),
    (["sparse", "dense", "sparse"], "is not dense layers followed by sparse ones"),
])
def test_glm_flash_config_in_newer_transformers_form_says_the_key_to_add(types, says):
    """A GLM-4.7-Flash config saved by newer transformers has mlp_layer_types in place of first_k_dense_replace,
    which vLLM's Glm4MoeLite reads (the nineteenth run's held-out pack): the refusal names the value to add."""
    config = dict(_minimal("Glm4MoeLiteForCausalLM"), mlp_layer_types=types)
    del config["first_k_dense_replace"]
    [problem] = _problems("Glm4MoeLiteForCausalLM", config)
    assert "expected first_k_dense_replace, which vLLM's Glm4MoeLite reads with no default" in problem
    assert says in problem


@pytest.mark.parametrize("key, value, expected", [
    ("rms_norm_eps", 0, "rms_norm_eps above 0"),
    ("rms_norm_eps", -1e-6, "rms_norm_eps above 0"),
    ("rope_theta", 0.0, "rope_theta above 0"),
    ("num_experts_per_tok", 0, "num_experts_per_tok at least 1"),
    ("hidden_size", "256", "hidden_size as an integer"),
    ("rms_norm_eps", True, "rms_norm_eps as a number"),
])
def test_a_value_out_of_range_or_of_the_wrong_type_is_named(key, value, expected):
    config = dict(_minimal("Qwen3MoeForCausalLM"), **{key: value})
    [problem] = _problems("Qwen3MoeForCausalLM", config)
    assert expected in problem and repr(value) in problem


@pytest.mark.parametrize("key", sorted(MATH_KEYS))
def test_math_the_family_does_not_compute_is_refused(key):
    config = dict(_minimal("Qwen3MoeForCausalLM"), **{key: 7.0})
    [problem] = _problems("Qwen3MoeForCausalLM", config)
    assert f"no {key} (Qwen3-MoE packs are served without" in problem and "another model" in problem
    assert _problems("Qwen3MoeForCausalLM", dict(config, **{key: None})) == []


@pytest.mark.parametrize("key, value", [("swiglu_limit", 5.0), ("swiglu_alpha", 1.0), ("rms_norm_eps", 1e-6)])
def test_gpt_oss_values_vllm_ignores_must_be_the_ones_it_uses(key, value):
    config = _minimal("GptOssForCausalLM")
    assert _problems("GptOssForCausalLM", dict(config, swiglu_limit=7.0, swiglu_alpha=1.702)) == []
    [problem] = _problems("GptOssForCausalLM", dict(config, **{key: value}))
    assert "whatever the config says" in problem and repr(value) in problem


@pytest.mark.parametrize("name", FAMILY_PACKS)
def test_family_fixture_packs_are_complete(name):
    pack = Pack.open(FAMILIES_DIR / name)
    problems = [str(p) for p in pack.problems()]
    assert problems == [] and pack.notes[0].startswith(f"complete for {pack.architecture}"), problems


@pytest.mark.parametrize("name, key", [("minimaxm2-a-exl3-mcg-b3", "rotary_dim"),
                                       ("glm4moelite-a-exl3-mcg-b4", "first_k_dense_replace")])
def test_a_pack_whose_config_lacks_a_key_is_refused_before_anything_loads(name, key, tmp_path):
    root = tmp_path / name
    shutil.copytree(FAMILIES_DIR / name, root)
    config = json.loads((root / "config.json").read_text())
    del config[key]
    (root / "config.json").write_text(json.dumps(config))
    [problem] = Pack.open(root).problems()
    assert problem.file == str(root / "config.json") and f"expected {key}" in str(problem)


def _minimal(architecture: str) -> dict:
    """The config values of the fixture pack of `architecture`'s family (what the checks pass on)."""
    for name in FAMILY_PACKS:
        config = json.loads((FAMILIES_DIR / name / "config.json").read_text())
        if config["architectures"][0] == architecture:
            return config
    return json.loads((Path(__file__).resolve().parents[1] / "fixtures" / "exl3" / "qwen3moe-a-exl3-mul1-b4"
                       / "config.json").read_text())
