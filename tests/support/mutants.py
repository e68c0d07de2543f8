"""Pack mutants for the fail-closed tests: raw safetensors and JSON editing, the seeded mutation catalogue (one
category per way a pack can lie), and the gates a mutant goes through, run for real in process.

A gate's outcome is `refused` (a clean refusal naming what it must), `accepted` (the lie got through), `unclear`
(refused, but without naming the file or the tensor/key) or `crashed` (a traceback, an internal error, a hang).
"""

from __future__ import annotations

import contextlib
import io
import json
import random
import re
import shutil
import signal
import struct
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from .fixtures import pack_dir
from vllm_exl3 import demo

ST = "model.safetensors"
SIDECAR = "quantization_config.json"
INDEX = "model.safetensors.index.json"
RUN_TIMEOUT_S = 20
GATES = ("verify", "inspect", "preflight", "serve")


# -- raw safetensors and JSON editing ---------------------------------------------------------------------------
def copy_pack(source: Path, dst: Path) -> Path:
    """The pack's config, sidecar and weights (no tokenizer, no golden data: no gate reads them)."""
    dst.mkdir()
    for name in ("config.json", SIDECAR, ST):
        if (source / name).exists():
            shutil.copy(source / name, dst / name)
    return dst


def read_raw(path: Path) -> tuple[dict, bytes]:
    raw = path.read_bytes()
    n = struct.unpack("<Q", raw[:8])[0]
    return json.loads(raw[8:8 + n]), raw[8 + n:]


def write_raw(path: Path, header: dict | str, data: bytes) -> None:
    text = (header if isinstance(header, str) else json.dumps(header)).encode()
    path.write_bytes(struct.pack("<Q", len(text)) + text + data)


def rebuild(path: Path, tensors: dict[str, tuple[str, list[int], bytes]]) -> None:
    """A well-formed file holding `tensors` (name -> dtype, shape, bytes), contiguous."""
    header, blobs, pos = {}, [], 0
    for name, (dtype, shape, blob) in tensors.items():
        header[name] = {"dtype": dtype, "shape": shape, "data_offsets": [pos, pos + len(blob)]}
        blobs.append(blob)
        pos += len(blob)
    write_raw(path, header, b"".join(blobs))


def entries(path: Path) -> dict[str, tuple[str, list[int], bytes]]:
    header, data = read_raw(path)
    header.pop("__metadata__", None)
    return {k: (v["dtype"], v["shape"], data[v["data_offsets"][0]:v["data_offsets"][1]]) for k, v in header.items()}


def edit_json(path: Path, fn: Callable[[dict], None]) -> None:
    data = json.loads(path.read_text())
    fn(data)
    path.write_text(json.dumps(data))


def dup_key_text(obj: dict, key: str) -> str:
    """`obj` as JSON text with `key` written twice (the second copy is what a lax reader keeps)."""
    parts = [f"{json.dumps(k)}: {json.dumps(v)}" for k, v in obj.items()]
    parts.append(f"{json.dumps(key)}: {json.dumps(obj[key])}")
    return "{" + ", ".join(parts) + "}"


# -- running the CLI in process, with a hang detector -------------------------------------------------------------
class Hung(BaseException):
    """Not an Exception: the CLI's catch-all must not turn a hang into an exit code."""


@contextlib.contextmanager
def deadline(what: str, seconds: float = RUN_TIMEOUT_S):
    def alarm(*_):
        raise Hung(f"{what} still running after {seconds} s")

    previous = signal.signal(signal.SIGALRM, alarm)
    signal.setitimer(signal.ITIMER_REAL, seconds)
    try:
        yield
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)


def run_cli(*argv: str, seconds: float = RUN_TIMEOUT_S) -> tuple[int, str]:
    """`vllm-exl3 ARGV` in process: (exit status, stderr). stdout is discarded. `seconds`: the hang detector's limit
    (a command that asks vLLM's parser about options takes ~10 s, more on a loaded machine)."""
    from vllm_exl3.cli.main import main

    err = io.StringIO()
    with deadline(f"vllm-exl3 {' '.join(argv)[:200]}", seconds), contextlib.redirect_stderr(err), \
            contextlib.redirect_stdout(io.StringIO()):
        code = main(list(argv))
    return code, err.getvalue()


# -- the catalogue --------------------------------------------------------------------------------------------------
@dataclass
class Expect:
    file: str  # a file name the refusal must contain
    names: tuple[str, ...] = ()  # tensor or key names: the refusal must contain at least one
    gates: tuple[str, ...] = GATES
    target: Path | None = None  # what the gates are pointed at, when not the mutated pack itself


SOURCES = (pack_dir("qwen3moe-a-exl3-mcg-b3"), pack_dir("glm4moe-a-exl3-mcg-b4"),
           pack_dir("qwen3moe-a-exl3-3inst-b2"), demo.PACK)


def _modules(tensors) -> list[str]:
    return sorted({n.rpartition(".")[0] for n in tensors})


def _under(name: str, prefixes) -> bool:
    return any(name == p or name.startswith(p + ".") for p in prefixes)


def _exl3(tensors) -> list[str]:
    return sorted(n[: -len(".trellis")] for n in tensors if n.endswith(".trellis"))


def _config(root: Path) -> dict:
    return json.loads((root / "config.json").read_text())


def _experts_key(config: dict) -> str:
    return "n_routed_experts" if "n_routed_experts" in config else "num_experts"


def missing_tensor(rng, root):
    t = entries(root / ST)
    mods = _modules(t)
    kind = rng.choice(["head", "attention", "norm", "expert", "expert_projection", "router", "many"])
    drop = {
        "head": lambda: ["lm_head"],
        "attention": lambda: [rng.choice([m for m in mods if re.search(r"self_attn\.[qkvo]_proj$", m)])],
        "norm": lambda: [rng.choice([m for m in mods if m.endswith("norm")])],
        "expert": lambda: [rng.choice(sorted({m.rpartition(".")[0] for m in mods if ".experts." in m}))],
        "expert_projection": lambda: [rng.choice([m for m in mods if ".experts." in m])],
        "router": lambda: [rng.choice([m for m in mods if m.endswith(".mlp.gate")])],
        "many": lambda: rng.sample(mods, len(mods) // 5),  # an overlay that kept 4/5 of the tensors
    }[kind]()
    rebuild(root / ST, {k: v for k, v in t.items() if not _under(k, drop)})
    return Expect("config.json", tuple(drop))


def unexpected_tensor(rng, root):
    t = entries(root / ST)
    config = _config(root)
    prefix = rng.choice(_exl3(t))
    kt, nt, _ = t[f"{prefix}.trellis"][1]
    kind = rng.choice(["stale_weight", "legacy_su", "extra_expert", "extra_layer", "foreign", "bias"])
    if kind == "stale_weight":
        name, value = f"{prefix}.weight", ("BF16", [nt * 16, kt * 16], bytes(nt * kt * 512))
    elif kind == "legacy_su":
        name, value = f"{prefix}.su", ("I16", [kt], bytes(2 * kt))
    elif kind == "extra_expert":
        layer = rng.choice(sorted({n.split(".experts.")[0] for n in t if ".experts." in n}))
        name = f"{layer}.experts.{config[_experts_key(config)]}.up_proj"
        for k, v in [(k, v) for k, v in t.items() if k.startswith(f"{layer}.experts.0.up_proj.")]:
            t[name + "." + k.rpartition(".")[2]] = v
        rebuild(root / ST, t)
        return Expect(ST, (name,))
    elif kind == "extra_layer":
        name = f"model.layers.{config['num_hidden_layers'] + rng.randint(2, 9)}.input_layernorm.weight"
        value = t["model.layers.0.input_layernorm.weight"]
    elif kind == "foreign":
        name, value = f"model.layers.0.mlp.{rng.choice(['foo', 'adapter', 'lora_A'])}.weight", ("BF16", [4], bytes(8))
    else:
        prefix = rng.choice([p for p in _exl3(t) if ".self_attn." in p])
        out = t[f"{prefix}.trellis"][1][1] * 16
        name, value = f"{prefix}.bias", ("F16", [out], bytes(2 * out))
    t[name] = value
    rebuild(root / ST, t)
    return Expect(ST, (name,))


def config_value(rng, root):
    config = _config(root)
    experts = _experts_key(config)
    layers = config["num_hidden_layers"]
    qc = [("bits", v) for v in ("abc", True, -4, "4", [4])] + [
        ("head_bits", "six"), ("layer_bits", {"1": 7}), ("layer_bits", {"x": 4}), ("layer_bits", {"1": "abc"}),
        ("layer_bits", [4]), ("non_routed_exl3", [1]), ("non_routed_exl3", {"layers": [1]}),
        ("non_routed_exl3", {"modules": "q_proj"}), ("non_routed_exl3", {"modules": ["q_proj"], "bits": 7}),
        ("non_routed_exl3", {"module": ["q_proj"]}),
        ("non_routed_exl3", {"layers": {"model.layers.0.self_attn.qkv_proj": {"bits": "x"}}}),
        ("non_routed_exl3", {"layers": {"model.layers.0.self_attn.qkv_proj": {"bf16_shards": 5}}}),
        ("non_routed_dtype_policy", "sometimes"), ("non_routed_quantization", {"quant_method": "exl3"}),
        ("non_routed_quantization", "fp8")]
    top = [("num_hidden_layers", layers + rng.randint(1, 4)), ("num_hidden_layers", 2**62), ("num_hidden_layers", 0),
           ("num_experts_per_tok", 0), ("num_experts_per_tok", config[experts] + rng.randint(1, 8)),
           ("num_experts_per_tok", -1), (experts, config[experts] * 2), (experts, 2**40),
           ("max_position_embeddings", 0), ("max_position_embeddings", -1), ("max_position_embeddings", "4096"),
           ("max_position_embeddings", 4096.5), ("max_position_embeddings", float("nan")),
           ("max_position_embeddings", float("inf")), ("max_position_embeddings", -float("inf"))]
    top += [("num_local_experts", config[experts] // 2), ("decoder_sparse_step", 0)] if experts == "num_experts" \
        else [("first_k_dense_replace", -1)]
    where, (key, value) = rng.choice([("quantization_config", kv) for kv in qc] + [("", kv) for kv in top])
    edit_json(root / "config.json",
              lambda c: (c[where] if where else c).__setitem__(key, value))
    return Expect("config.json", (key,))


def dtype_relabel(rng, root):
    """A 16-bit tensor relabelled F16 / BF16 / I16: the same bytes, other numbers. Mostly plain tensors (norms, the
    router, embeddings), whose dtype nothing but the converter's ledger records."""
    header, data = read_raw(root / ST)
    sixteen = sorted(k for k, v in header.items() if k != "__metadata__" and v["dtype"] in ("F16", "BF16", "I16"))
    linears = tuple(f"{p}." for p in _exl3(header))
    plain = [k for k in sixteen if not k.startswith(linears)]
    name = rng.choice(plain if rng.random() < 0.75 else sixteen)
    header[name]["dtype"] = rng.choice([d for d in ("F16", "BF16", "I16") if d != header[name]["dtype"]])
    write_raw(root / ST, header, data)
    return Expect(ST, (name,))


def nan_scale(rng, root):
    header, data = read_raw(root / ST)
    name = rng.choice(sorted(k for k in header if k.endswith((".suh", ".svh"))))
    begin, end = header[name]["data_offsets"]
    at = begin + 2 * rng.randrange((end - begin) // 2)
    value = rng.choice([0x7E00, 0x7C00, 0xFC00, 0x7C01])  # NaN, +Inf, -Inf, signalling NaN
    write_raw(root / ST, header, data[:at] + struct.pack("<H", value) + data[at + 2:])
    return Expect(ST, (name,), ("verify", "preflight", "serve"))  # inspect reads headers only


def huge_int(rng, root):
    digits = rng.choice([21, 400, 5000, 100_000])
    number = ("-" if rng.random() < 0.3 else "") + "9" * digits
    target = rng.choice(["config.json", SIDECAR, INDEX, ST])
    if target == ST:
        header, data = read_raw(root / ST)
        name = rng.choice(sorted(k for k in header if k != "__metadata__"))
        field_ = rng.choice(["data_offsets", "shape"])
        header[name][field_] = [-12345, -12345]
        write_raw(root / ST, json.dumps(header).replace("-12345", number, 1), data)
    elif target == INDEX:
        weight_map = {n: ST for n in entries(root / ST)}
        (root / INDEX).write_text('{"metadata": {"total_size": ' + number + '}, "weight_map": '
                                  + json.dumps(weight_map) + "}")
    else:
        text = (root / target).read_text()
        spots = list(re.finditer(r'": (-?\d+)(?=[,\s}\]])', text))  # integers, not the digits of a float
        m = rng.choice(spots)
        (root / target).write_text(text[:m.start(1)] + number + text[m.end(1):])
    return Expect(target)


def markup(rng, root):
    tag = rng.choice(["[/]", "[/red]", "[bold red]", "[link=file:///etc/passwd]x[/link]", "[/bold]"])
    kind = rng.choice(["tensor", "suffix", "codebook", "policy"])
    if kind in ("tensor", "suffix"):
        t = entries(root / ST)
        name = f"model.layers.0.{tag}weird.weight" if kind == "tensor" else f"{rng.choice(_exl3(t))}.{tag}"
        t[name] = ("BF16", [4], bytes(8))
        rebuild(root / ST, t)
        return Expect(ST, (name,))
    key = "codebook" if kind == "codebook" else "non_routed_dtype_policy"
    edit_json(root / "config.json", lambda c: c["quantization_config"].__setitem__(key, tag))
    return Expect("config.json", (tag,))


def long_name(rng, root):
    weight_map = {n: ST for n in entries(root / ST)}
    victim = rng.choice(sorted(weight_map))
    kind = rng.choice(["too_long", "too_long", "subdirectory", "parent", "nul", "pack_path"])
    if kind == "pack_path":  # the pack's own path: a component longer than the filesystem allows
        long = root / ("p" * rng.choice([256, 1000, 5000]))
        return Expect(long.name[:50], (), target=long)
    weight_map[victim] = {"too_long": "s" * rng.choice([244, 1000, 5000]) + ".safetensors",
                          "subdirectory": "sub/" + ST, "parent": f"../{root.name}/{ST}",
                          "nul": "model\0.safetensors"}[kind]
    (root / INDEX).write_text(json.dumps({"metadata": {}, "weight_map": weight_map}))
    return Expect(INDEX, (victim,))


CATEGORIES = (missing_tensor, unexpected_tensor, config_value, dtype_relabel, nan_scale, huge_int, markup, long_name)


@dataclass
class Mutant:
    category: str
    variant: int
    root: Path
    expect: Expect
    source: Path = field(default=Path())

    @property
    def target(self) -> Path:
        return self.expect.target or self.root


def make_mutant(seed: str, category: Callable, variant: int, tmp: Path) -> Mutant:
    """One mutant, made the same way for the same (seed, category, variant): a source pack copied to `tmp`, then
    changed in one way."""
    rng = random.Random(f"{seed}-{category.__name__}-{variant}")
    source = rng.choice(SOURCES)
    root = copy_pack(source, tmp / f"{category.__name__}-{variant}")
    return Mutant(category.__name__, variant, root, category(rng, root), source)


# -- the gates --------------------------------------------------------------------------------------------------------
def _cli(command: str) -> Callable[[Path], tuple[bool, str]]:
    def gate(target: Path) -> tuple[bool, str]:
        code, err = run_cli(command, str(target))
        return code == 0, err if code in (0, 1) else f"exit {code}: {err}"

    return gate


def _preflight(target: Path) -> tuple[bool, str]:
    from vllm_exl3.appliance.preflight import check_pack

    with deadline(f"preflight {target}"):
        check, _ = check_pack(target)
    return check.ok, check.detail


def _serve(target: Path) -> tuple[bool, str]:
    """What `Exl3Config.maybe_update_config` reads inside plain `vllm serve` (tests/integration runs the class)."""
    from vllm_exl3.format.errors import Exl3FormatError
    from vllm_exl3.format.index import index_model

    try:
        with deadline(f"index_model {target}"):
            index_model(str(target))
    except Exl3FormatError as e:
        return False, str(e)
    return True, ""


GATE_RUNNERS: dict[str, Callable[[Path], tuple[bool, str]]] = {
    "verify": _cli("verify"), "inspect": _cli("inspect"), "preflight": _preflight, "serve": _serve}


def outcome(expect: Expect, accepted: bool, text: str) -> str:
    """refused | accepted | unclear | crashed, for one gate's result."""
    if "Traceback" in text or "internal error" in text or text.startswith("exit "):
        return "crashed"
    if accepted:
        return "accepted"
    if expect.file not in text or (expect.names and not any(n in text for n in expect.names)):
        return "unclear"
    return "refused"


def run_gate(gate: str, mutant: Mutant) -> tuple[str, str]:
    """(outcome, what the gate said); an exception out of the gate is a crash."""
    try:
        accepted, text = GATE_RUNNERS[gate](mutant.target)
    except (Exception, Hung) as e:  # noqa: BLE001 - every escape is the finding
        return "crashed", f"{type(e).__name__}: {e}"
    return outcome(mutant.expect, accepted, text), text
