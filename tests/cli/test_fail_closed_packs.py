"""Fail closed, round 2: a seeded mutation test of what every gate must catch in a pack, through `verify`,
`inspect`, preflight's pack check and the serve-time index that `Exl3Config.maybe_update_config` reads inside plain
`vllm serve` (tests/integration/test_serve_time_gate.py runs that class on the same mutants; tests/e2e the server).

One category per way a pack can lie (tests/support/mutants.py): a missing tensor, an unexpected one, a config value
that makes wrong output or a later crash, a relabelled dtype, a non-finite scale, a huge integer in any JSON, Rich
markup in a name or config string, a name longer than the filesystem allows. Every mutant must be refused by every
gate with one message naming the file and the tensor or key, without a traceback or a hang.
"""

from __future__ import annotations

import json
import math
import os

import pytest
from support.fixtures import PACKS, pack_dir
from support.mutants import (CATEGORIES, GATE_RUNNERS, GATES, INDEX, SIDECAR, SOURCES, ST, Expect, Mutant, copy_pack,
                             edit_json, entries, make_mutant, read_raw, rebuild, run_cli, run_gate, write_raw)
from vllm_exl3 import demo

SEED = "fail-closed-2"
VARIANTS = 6  # per category
CASES = [(c, v) for c in CATEGORIES for v in range(VARIANTS)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("category,variant", CASES, ids=[f"{c.__name__}-{v}" for c, v in CASES])
def test_mutant_is_refused_by_every_gate(tmp_path, category, variant):
    mutant = make_mutant(SEED, category, variant, tmp_path)
    results = {gate: run_gate(gate, mutant) for gate in mutant.expect.gates}
    wrong = {gate: f"{result}: {text[-1500:]}" for gate, (result, text) in results.items() if result != "refused"}
    assert not wrong, f"{mutant.category}-{variant} of {mutant.source.name} (expect {mutant.expect}): {wrong}"


@pytest.mark.parametrize("pack", [*PACKS, demo.PACK.name])
def test_fixture_and_demo_packs_pass_every_gate(tmp_path, pack):
    """The control: the real ExLlamaV3 packs and the demo pass all of it, `verify --deep` included, and each is
    checked complete against its architecture's table."""
    source = demo.PACK if pack == demo.PACK.name else pack_dir(pack)
    root = copy_pack(source, tmp_path / pack)
    for gate in GATES:
        accepted, text = GATE_RUNNERS[gate](root)
        assert accepted, f"{gate}: {text}"
    code, err = run_cli("verify", "--deep", str(source))
    assert code == 0, err


def test_verify_says_what_completeness_covered(tmp_path, capsys):
    from vllm_exl3.cli.main import main

    root = copy_pack(SOURCES[0], tmp_path / "p")
    assert main(["verify", str(root)]) == 0
    assert "note: complete for Qwen3MoeForCausalLM (num_hidden_layers = 2, num_experts = 8)" in capsys.readouterr().out
    edit_json(root / "config.json", lambda c: c.__setitem__("architectures", ["SomeNewMoeForCausalLM"]))
    assert main(["verify", str(root)]) == 0  # an architecture without a table is not refused...
    out = capsys.readouterr().out
    assert "completeness not checked: no tensor table for 'SomeNewMoeForCausalLM'" in out  # ...but said
    assert "checked against the converter's tensor_storage ledger instead" in out


def test_markup_in_an_accepted_pack_prints_as_it_is(tmp_path, capsys):
    """Config strings nobody refuses (model_type, version) reach `inspect`'s output: printed, never parsed."""
    from vllm_exl3.cli.main import main

    root = copy_pack(SOURCES[0], tmp_path / "p")
    edit_json(root / "config.json", lambda c: (c.__setitem__("model_type", "[/]qwen[bold]"),
                                               c["quantization_config"].__setitem__("version", "[/red]1.6")))
    assert main(["inspect", str(root)]) == 0
    out = capsys.readouterr().out
    assert "([/]qwen[bold])" in out and "version=[/red]1.6" in out


def test_ledger_without_a_table_finds_a_missing_module(tmp_path):
    """An architecture without a table still has the converter's ledger: a module it records is missing."""
    from vllm_exl3.format.pack import verify_pack

    root = copy_pack(SOURCES[0], tmp_path / "p")
    edit_json(root / "config.json", lambda c: c.__setitem__("architectures", ["SomeNewMoeForCausalLM"]))
    t = entries(root / ST)
    rebuild(root / ST, {k: v for k, v in t.items() if not k.startswith("model.layers.1.mlp.experts.5.down_proj.")})
    _, problems = verify_pack(root)
    assert [p.tensor for p in problems] == ["model.layers.1.mlp.experts.5.down_proj"]
    assert "quantization_config.json" in str(problems[0]) and "trellis" in str(problems[0])


# -- the issue's own examples, one by one (the seeded categories above draw from the same kinds) ------------------
def _drop(*modules):
    def mutate(root):
        t = entries(root / ST)
        rebuild(root / ST, {k: v for k, v in t.items() if not any(k.startswith(m + ".") for m in modules)})
        return Expect("config.json", modules)
    return mutate


def _drop_modules_holding(count):
    def mutate(root):  # an overlay that kept 240 - `count` of the tensors: whole modules left behind
        t = entries(root / ST)
        modules, gone = sorted({k.rpartition(".")[0] for k in t}), []
        for module in modules[::5]:
            if sum(k.rpartition(".")[0] in gone for k in t) >= count:
                break
            gone.append(module)
        rebuild(root / ST, {k: v for k, v in t.items() if k.rpartition(".")[0] not in gone})
        return Expect("config.json", tuple(gone))
    return mutate


def _add(name, dtype, shape):
    def mutate(root):
        t = entries(root / ST)
        t[name] = (dtype, shape, bytes(2 * math.prod(shape)))
        rebuild(root / ST, t)
        return Expect(ST, (name,))
    return mutate


def _config(key, value, qc=False):
    def mutate(root):
        edit_json(root / "config.json", lambda c: (c["quantization_config"] if qc else c).__setitem__(key, value))
        return Expect("config.json", (key,))
    return mutate


def _relabel(name, dtype):
    def mutate(root):
        header, data = read_raw(root / ST)
        header[name]["dtype"] = dtype
        write_raw(root / ST, header, data)
        return Expect(ST, (name,))
    return mutate


def _huge(file):
    def mutate(root):
        number = "1" + "0" * 5000
        if file == INDEX:
            (root / INDEX).write_text('{"metadata": {"total_size": ' + number + '}, "weight_map": '
                                      + json.dumps({n: ST for n in entries(root / ST)}) + "}")
        elif file == ST:
            header, data = read_raw(root / ST)
            write_raw(root / ST, json.dumps(header).replace('"data_offsets": [0,', f'"data_offsets": [{number},', 1),
                      data)
        else:
            text = (root / file).read_text()
            old = '"version": "1.6.5"' if file == SIDECAR else '"vocab_size": 2048'
            (root / file).write_text(text.replace(old, f'{old.split(":")[0]}: {number}', 1))
        return Expect(file)
    return mutate


def _side_file(name, change):
    """A file beside the weights that vLLM or transformers reads at boot, copied from the source pack and changed
    (copy_pack leaves them out: the gates did not read them)."""
    def mutate(root):
        source = SOURCES[0] / name
        (root / name).write_bytes(source.read_bytes() if source.exists() else b"{}")
        change(root / name)
        return Expect(name)
    return mutate


def _huge_in(path):
    data = json.loads(path.read_text())
    path.write_text(json.dumps(data)[:-1] + ', "x_huge": ' + "1" + "0" * 5000 + "}")


def _unreadable(path):
    if os.geteuid() == 0:
        pytest.skip("root reads a mode-000 file")
    path.chmod(0)


def _a_folder(path):
    path.unlink()
    path.mkdir()


def _long_shard_name(root):
    weight_map = {n: ST for n in entries(root / ST)}
    weight_map["model.norm.weight"] = "x" * 300 + ".safetensors"
    (root / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return Expect(INDEX, ("model.norm.weight",))


def _nan_scale(root):
    header, data = read_raw(root / ST)
    begin = header["model.layers.1.self_attn.o_proj.svh"]["data_offsets"][0]
    write_raw(root / ST, header, data[:begin] + b"\x00\x7e" + data[begin + 2:])
    return Expect(ST, ("model.layers.1.self_attn.o_proj.svh",), ("verify", "preflight", "serve"))


ISSUE_EXAMPLES = {
    "no lm_head": _drop("lm_head"),
    "no k and o projections": _drop("model.layers.1.self_attn.k_proj", "model.layers.1.self_attn.o_proj"),
    "no norm": _drop("model.layers.0.post_attention_layernorm"),
    "no expert": _drop("model.layers.1.mlp.experts.6"),
    "overlay kept 194 of 240 tensors": _drop_modules_holding(46),
    "stale .weight beside an EXL3 linear": _add("model.layers.0.self_attn.o_proj.weight", "BF16", [256, 256]),
    "legacy .su beside an EXL3 linear": _add("model.layers.0.self_attn.o_proj.su", "I16", [16]),
    "num_hidden_layers above the pack's": _config("num_hidden_layers", 3),
    "num_experts_per_tok 0": _config("num_experts_per_tok", 0),
    "num_experts_per_tok above num_experts": _config("num_experts_per_tok", 9),
    "bits 'abc'": _config("bits", "abc", qc=True),
    "layer_bits contradicting the trellis": _config("layer_bits", {"0": 4}, qc=True),
    "malformed non_routed_exl3": _config("non_routed_exl3", {"layers": ["q_proj"]}, qc=True),
    "malformed non_routed_quantization": _config("non_routed_quantization", ["fp8"], qc=True),
    "F16 relabelled BF16": _relabel("model.layers.0.mlp.gate.weight", "BF16"),
    "BF16 relabelled F16": _relabel("model.layers.0.input_layernorm.weight", "F16"),
    "BF16 relabelled I16": _relabel("model.embed_tokens.weight", "I16"),
    "NaN scale": _nan_scale,
    "huge integer in config.json": _huge("config.json"),
    "huge integer in the sidecar": _huge(SIDECAR),
    "huge integer in the index": _huge(INDEX),
    "huge integer in a safetensors header": _huge(ST),
    "markup in a tensor name": _add("model.layers.0.[/]mlp.weight", "BF16", [4]),
    "markup in a config string": _config("codebook", "[/]", qc=True),
    "shard name longer than the filesystem allows": _long_shard_name,
    "non-finite max_position_embeddings": _config("max_position_embeddings", float("inf")),
    "huge integer in generation_config.json": _side_file("generation_config.json", _huge_in),
    "huge integer in tokenizer_config.json": _side_file("tokenizer_config.json", _huge_in),
    "tokenizer.json of mode 000": _side_file("tokenizer.json", _unreadable),
    "tokenizer.json that is a folder": _side_file("tokenizer.json", _a_folder),
    "generation_config.json cut short": _side_file("generation_config.json",
                                                    lambda p: p.write_text(p.read_text()[:-2])),
}


@pytest.mark.parametrize("example", ISSUE_EXAMPLES)
def test_the_issues_examples_are_refused_by_every_gate(tmp_path, example):
    root = copy_pack(SOURCES[0], tmp_path / "p")  # qwen3moe-a-exl3-mcg-b3: 240 tensors
    mutant = Mutant("example", 0, root, ISSUE_EXAMPLES[example](root), SOURCES[0])
    results = {gate: run_gate(gate, mutant) for gate in mutant.expect.gates}
    wrong = {gate: f"{result}: {text[-1500:]}" for gate, (result, text) in results.items() if result != "refused"}
    assert not wrong, f"{example} (expect {mutant.expect}): {wrong}"


def test_serve_refuses_a_pack_with_markup_in_a_name_as_text(tmp_path):
    """`vllm-exl3 serve` prints the refusal as it is: a tensor named '[/]' is not Rich markup (it was an internal
    error, MarkupError)."""
    root = copy_pack(SOURCES[0], tmp_path / "p")
    ISSUE_EXAMPLES["stale .weight beside an EXL3 linear"](root)
    _add("model.layers.0.[/]mlp.weight", "BF16", [4])(root)
    code, err = run_cli("serve", str(root))
    assert code == 1 and "refusing to serve" in err and "[/]" in err and "internal error" not in err, err


# -- round 3: config values each family reads, checked against its table; dtypes the architecture implies --------
def _config_of(**values):
    def mutate(root):
        edit_json(root / "config.json", lambda c: c.update(values))
        return Expect("config.json", tuple(values))
    return mutate


def _without_sidecar(mutate):
    def without(root):
        (root / SIDECAR).unlink()  # packs usually come without it: the dtype is then checked from the architecture
        return mutate(root)
    return without


GLM, QWEN = SOURCES[1], SOURCES[0]
ROUND3_EXAMPLES = {  # (source, mutation): each passed every gate, then served wrong text, NaN or an HTTP 500
    "GLM num_hidden_layers one below the layers stored": (GLM, lambda root: (
        _config_of(num_hidden_layers=2)(root), Expect(ST, ("num_nextn_predict_layers",)))[1]),
    "topk_group above n_group": (GLM, _config_of(topk_group=2)),
    "n_group not dividing the experts": (GLM, _config_of(n_group=3, topk_group=1)),
    "n_group 0": (GLM, _config_of(n_group=0)),
    "more experts than the chosen groups hold": (GLM, _config_of(n_group=4, topk_group=1, num_experts_per_tok=3)),
    "routed_scaling_factor 0": (GLM, _config_of(routed_scaling_factor=0)),
    "no routed_scaling_factor": (GLM, lambda root: (
        edit_json(root / "config.json", lambda c: c.pop("routed_scaling_factor")),
        Expect("config.json", ("routed_scaling_factor",)))[1]),
    "rms_norm_eps 0": (QWEN, _config_of(rms_norm_eps=0)),
    "rms_norm_eps negative": (GLM, _config_of(rms_norm_eps=-1e-6)),
    "rope_theta 0": (QWEN, _config_of(rope_theta=0)),
    "rope_parameters.rope_theta 0": (GLM, _config_of(rope_parameters={"rope_theta": 0.0, "rope_type": "default"})),
    "rope_parameters a string": (GLM, _config_of(rope_parameters="default")),
    "rope_parameters a list": (QWEN, _config_of(rope_parameters=[10000.0])),
    "BF16 norm relabelled F16 without the sidecar": (QWEN, _without_sidecar(
        _relabel("model.layers.0.input_layernorm.weight", "F16"))),
    "BF16 embeddings relabelled F16 without the sidecar": (GLM, _without_sidecar(
        _relabel("model.embed_tokens.weight", "F16"))),
    "F32 correction bias relabelled I32 without the sidecar": (GLM, _without_sidecar(
        _relabel("model.layers.1.mlp.gate.e_score_correction_bias", "I32"))),
}


@pytest.mark.parametrize("example", ROUND3_EXAMPLES)
def test_round3_examples_are_refused_by_every_gate_before_the_boot(tmp_path, example):
    source, mutate = ROUND3_EXAMPLES[example]
    root = copy_pack(source, tmp_path / "p")
    mutant = Mutant("example", 0, root, mutate(root), source)
    results = {gate: run_gate(gate, mutant) for gate in mutant.expect.gates}
    wrong = {gate: f"{result}: {text[-1500:]}" for gate, (result, text) in results.items() if result != "refused"}
    assert not wrong, f"{example} (expect {mutant.expect}): {wrong}"


def test_a_tokenizer_config_with_transformers_very_large_model_max_length_is_accepted(tmp_path):
    """transformers writes model_max_length int(1e30) when a tokenizer has no limit: beyond 64 bits, but no mistake
    (the files beside the weights are held to Python's integer limit, not the pack's)."""
    root = copy_pack(SOURCES[0], tmp_path / "p")
    (root / "tokenizer_config.json").write_text('{"model_max_length": 1000000000000000019884624838656}')
    code, err = run_cli("verify", str(root))
    assert code == 0, err
