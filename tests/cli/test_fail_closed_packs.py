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

import pytest
from conftest import PACKS, pack_dir
from support.mutants import (CATEGORIES, GATES, SOURCES, copy_pack, edit_json, make_mutant, run_cli, run_gate)
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
        accepted, text = __import__("support.mutants", fromlist=["GATE_RUNNERS"]).GATE_RUNNERS[gate](root)
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
    from support.mutants import ST, entries, rebuild

    from vllm_exl3.format.pack import verify_pack

    root = copy_pack(SOURCES[0], tmp_path / "p")
    edit_json(root / "config.json", lambda c: c.__setitem__("architectures", ["SomeNewMoeForCausalLM"]))
    t = entries(root / ST)
    rebuild(root / ST, {k: v for k, v in t.items() if not k.startswith("model.layers.1.mlp.experts.5.down_proj.")})
    _, problems = verify_pack(root)
    assert [p.tensor for p in problems] == ["model.layers.1.mlp.experts.5.down_proj"]
    assert "quantization_config.json" in str(problems[0]) and "trellis" in str(problems[0])
