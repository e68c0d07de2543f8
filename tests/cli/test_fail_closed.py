"""Fail closed (issue 19): a seeded, bounded fuzz over every way a pack can lie, through the CLI.

Each case mutates a copy of a fixture pack in one category and runs `verify`, `inspect` and `dequant` in process.
The outcome class must be a clean refusal: exit 1, stderr one paragraph naming the file (and the tensor where one
is at fault), no traceback, no internal error, no hang (a per-run alarm), never a silent accept.
"""

from __future__ import annotations

import json
import os
import random
from dataclasses import dataclass
from pathlib import Path

import pytest
from support.fixtures import pack_dir
from support.mutants import (ST, SIDECAR, copy_pack as copy_source, dup_key_text, edit_json, entries, nan_scale,
                             read_raw, rebuild, run_cli as run_cli_capturing, write_raw)

SEED = 19
VARIANTS = 3  # per category
SOURCE = pack_dir("qwen3moe-a-exl3-mcg-b3")
COMMANDS = ("verify", "inspect", "dequant")


def copy_pack(dst: Path) -> Path:
    return copy_source(SOURCE, dst)


# -- the categories: each mutates `root` and says what the refusal must name --------------------------------
@dataclass
class Expect:
    file: str  # a file name the message must contain
    tensor: str | None = None  # a tensor name it must contain
    commands: tuple[str, ...] = COMMANDS


def _pick(rng: random.Random, root: Path, suffix: str) -> str:
    return rng.choice(sorted(n for n in read_raw(root / ST)[0] if n.endswith(suffix)))


def dup_header_key(rng, root):
    header, data = read_raw(root / ST)
    name = rng.choice(sorted(k for k in header if k != "__metadata__"))
    write_raw(root / ST, dup_key_text(header, name), data)
    return Expect(ST, name)


def dup_json_key(rng, root):
    fname = rng.choice(["config.json", SIDECAR])
    obj = json.loads((root / fname).read_text())
    key = rng.choice(sorted(obj))
    (root / fname).write_text(dup_key_text(obj, key))
    return Expect(fname)


def unknown_suffix(rng, root):
    marker = _pick(rng, root, ".mcg")
    prefix = marker[: -len(".mcg")]
    new = prefix + rng.choice(["&mcg", ".mcgx", ".foo", "#mcg", ".scale"])
    tensors = {(new if k == marker else k): v for k, v in entries(root / ST).items()}
    rebuild(root / ST, tensors)
    return Expect(ST, new)


def markers_deleted(rng, root):
    tensors = entries(root / ST)
    drop = [k for k in tensors if k.endswith(".mcg")]
    if rng.random() < 0.5:  # every marker, or one
        drop = [rng.choice(drop)]
    rebuild(root / ST, {k: v for k, v in tensors.items() if k not in drop})
    return Expect(ST, ".trellis")


def config_codebook(rng, root):
    cb = rng.choice(["mul1", "3inst"])
    edit_json(root / "config.json", lambda c: c["quantization_config"].__setitem__("codebook", cb))
    return Expect("config.json", ".mcg")


def ledger_codebook(rng, root):
    def fn(s):
        exl3 = sorted(m for m, e in s["tensor_storage"].items() if "mcg_multiplier" in e)
        module = rng.choice(exl3)
        entry = s["tensor_storage"][module]
        value = entry.pop("mcg_multiplier")
        if rng.random() < 0.5:
            entry["mul1_multiplier"] = value
        fn.module = module

    edit_json(root / SIDECAR, fn)
    return Expect(SIDECAR, fn.module)


def overlap(rng, root):
    header, data = read_raw(root / ST)
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    i = rng.randrange(1, len(names))
    begin, end = header[names[i]]["data_offsets"]
    shift = rng.randint(1, min(64, begin))
    header[names[i]]["data_offsets"] = [begin - shift, end - shift]
    write_raw(root / ST, header, data)
    return Expect(ST, "")


def hole(rng, root):
    header, data = read_raw(root / ST)
    names = sorted((k for k in header if k != "__metadata__"), key=lambda k: header[k]["data_offsets"][0])
    i = rng.randrange(1, len(names))
    at, gap = header[names[i]]["data_offsets"][0], rng.choice([1, 2, 8, 4096])
    for n in names[i:]:
        header[n]["data_offsets"] = [o + gap for o in header[n]["data_offsets"]]
    write_raw(root / ST, header, data[:at] + bytes(gap) + data[at:])
    return Expect(ST, names[i])


def trailing_bytes(rng, root):
    header, data = read_raw(root / ST)
    write_raw(root / ST, header, data + bytes(rng.choice([1, 7, 4096])))
    return Expect(ST, "")


def alias(rng, root):
    header, data = read_raw(root / ST)
    victim = _pick(rng, root, rng.choice([".suh", ".trellis"]))
    twins = sorted(k for k, v in header.items() if k not in ("__metadata__", victim)
                   and v["data_offsets"][1] - v["data_offsets"][0] == (header[victim]["data_offsets"][1]
                                                                      - header[victim]["data_offsets"][0]))
    header[victim]["data_offsets"] = list(header[rng.choice(twins)]["data_offsets"])
    write_raw(root / ST, header, data)
    return Expect(ST, "")


def empty_name(rng, root):
    tensors = entries(root / ST)
    name = rng.choice(sorted(tensors))
    rebuild(root / ST, {("" if k == name else k): v for k, v in tensors.items()})
    return Expect(ST, "''")


def wrong_dtype(rng, root):
    header, data = read_raw(root / ST)
    name = rng.choice(sorted(k for k in header if k != "__metadata__"))
    header[name]["dtype"] = rng.choice(["F4", ["I16"], {"I16": 1}, 16, None, "Q4"])
    write_raw(root / ST, header, data)
    return Expect(ST, name)


def config_types(rng, root):
    key, value = rng.choice([("quantization_config", ["exl3"]), ("quantization_config", "exl3"),
                             ("text_config", [1]), ("text_config", "qwen"), ("architectures", "Qwen3MoeForCausalLM"),
                             ("architectures", [1]), ("architectures", [{"a": 1}]), ("hidden_size", "256"),
                             ("num_attention_heads", [4]), ("model_type", 3)])
    edit_json(root / "config.json", lambda c: c.__setitem__(key, value))
    return Expect("config.json")


def index_types(rng, root):
    names = sorted(k for k in read_raw(root / ST)[0] if k != "__metadata__")
    weight_map = {n: ST for n in names}
    victim = rng.choice(names)
    weight_map[victim] = rng.choice([1, None, [ST], {"f": ST}, True])
    (root / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return Expect("model.safetensors.index.json", victim)


def deep_json(rng, root):
    depth = rng.choice([10_000, 100_000])
    target = rng.choice(["config.json", SIDECAR, ST])
    nest = "[" * depth + "]" * depth
    if target == ST:
        _, data = read_raw(root / ST)
        write_raw(root / ST, '{"__metadata__": ' + nest + "}", data)
    else:
        text = (root / target).read_text().rstrip()
        (root / target).write_text(text[:-1] + ', "x": ' + nest + "}")
    return Expect(target)


def fifo(rng, root):
    target = rng.choice(["config.json", ST, SIDECAR])
    (root / target).unlink()
    os.mkfifo(root / target)
    return Expect(target)


def non_finite_scale(rng, root):
    return Expect(ST, nan_scale(rng, root).names[0], ("verify", "dequant"))


CATEGORIES = [dup_header_key, dup_json_key, unknown_suffix, markers_deleted, config_codebook, ledger_codebook,
              overlap, hole, trailing_bytes, alias, empty_name, wrong_dtype, config_types, index_types, deep_json,
              fifo, non_finite_scale]


# -- running the CLI in process ------------------------------------------------------------------------------
def run_cli(capsys, *argv: str) -> tuple[int, str]:
    code, err = run_cli_capturing(*argv)
    capsys.readouterr()
    return code, err


def argv_for(command: str, root: Path, out: Path) -> list[str]:
    if command == "dequant":
        return ["dequant", str(root), "-o", str(out), "--tensor", "model.layers.0.self_attn.q_proj"]
    return [command, str(root)]


def assert_clean_refusal(code: int, err: str, expect: Expect, what: str) -> None:
    assert code == 1, f"{what}: exit {code} (a silent accept or a crash), stderr: {err}"
    assert "Traceback" not in err and "internal error" not in err, f"{what}: {err}"
    assert "\n\n" not in err.strip(), f"{what}: more than one paragraph: {err}"
    assert expect.file in err, f"{what}: the message does not name {expect.file}: {err}"
    if expect.tensor is not None:
        assert expect.tensor in err, f"{what}: the message does not name tensor {expect.tensor!r}: {err}"
        if expect.tensor in ("", "''", ".trellis", ".mcg"):
            assert "tensor '" in err or "''" in err, f"{what}: no tensor named: {err}"


CASES = [(cat, v) for cat in CATEGORIES for v in range(VARIANTS)]


@pytest.mark.timeout(120)
@pytest.mark.parametrize("category,variant", CASES, ids=[f"{c.__name__}-{v}" for c, v in CASES])
def test_mutated_pack_is_refused_cleanly(tmp_path, capsys, category, variant):
    rng = random.Random(f"{SEED}-{category.__name__}-{variant}")
    root = copy_pack(tmp_path / "pack")
    expect = category(rng, root)
    for command in expect.commands:
        code, err = run_cli(capsys, *argv_for(command, root, tmp_path / "out.safetensors"))
        assert_clean_refusal(code, err, expect, f"{category.__name__}-{variant} {command}")
        assert not (tmp_path / "out.safetensors").exists()


def test_the_unmutated_copy_is_accepted(tmp_path, capsys):
    """The control: the same runs on an untouched copy succeed (a refusal above is the mutation's doing)."""
    root = copy_pack(tmp_path / "pack")
    for command in COMMANDS:
        code, err = run_cli(capsys, *argv_for(command, root, tmp_path / "out.safetensors"))
        assert code == 0, f"{command}: {err}"
    assert (tmp_path / "out.safetensors").is_file()


@pytest.mark.parametrize("inside", [ST, "sub/x.safetensors", "new.safetensors"])
def test_dequant_refuses_an_output_inside_the_pack(tmp_path, capsys, inside):
    root = copy_pack(tmp_path / "pack")
    (root / "sub").mkdir()
    before = (root / ST).read_bytes()
    code, err = run_cli(capsys, "dequant", str(root), "-o", str(root / inside))
    assert code == 1 and "inside the pack" in err and "Traceback" not in err
    assert (root / ST).read_bytes() == before and not (root / "new.safetensors").exists()
