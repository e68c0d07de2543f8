"""Every MoE family the plugin serves, through vLLM's CPU build and the plugin, against two oracles:

- ExLlamaV3's own goldens on the packs its converter made (tests/fixtures/exl3-families, PROVENANCE.md);
- transformers' own model class on packs the plugin's writer makes in ExLlamaV3's layout, at another geometry
  (dev/family_oracle.py HELD_OUT): the activation, biases, routing and attention variants are
  transformers' implementation there, not ours.

Bounds as tests/e2e/test_e2e_serving.py's: top-1 >= 0.97, median |Δ log p| <= 0.05, at fp32. vLLM's CPU build runs
the gated delta net (Qwen3-Next, Qwen3.5) in bf16 only, so those servers are compared at bf16: a golden top-2 margin
below bf16's resolution (golden_logprobs.BF16_MARGIN) has no order to agree with, and a bf16 router flips experts
whose logits are closer than its rounding (Qwen3.5's fixture: one such flip in 62 positions, router logits 0.0044
apart), so top-1 must reach golden_logprobs.BF16_TOP1 there. Against ExLlamaV3's goldens (fp16 through every layer,
where the server is bf16 through every layer) the errors add up over the layers, not only in the last rounding: on
an AMD EPYC box with avx512_bf16 the bf16 server put Qwen3.5's golden top two in the other order at 4 of those 62
positions, golden margins 0.011-0.083 nats apart (the earlier CI box: 1 of 62), with a median |Δ log p| of 0.004. Those
comparisons count positions whose golden top two are more than HYBRID_GOLDEN_MARGIN apart (24-25 of each pack's 72);
the median bound holds everywhere. The same packs with a float32 stand-in for vLLM's delta-net op (not in this
suite: it replaces vLLM code) agree at fp32 to |Δ log p| < 1e-5: docs/vllm-notes.md §8.

The single-rank servers boot two at a time, side by side (the `agreements` fixture): a CPU boot is mostly
single-threaded imports, so two take about one boot's wait on a 2-core CI box.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
from pathlib import Path

import pytest
from safetensors.torch import load_file
from support import qwen3_vl
from support.servers import BOOT_TIMEOUT_S, SideBySide, cpu_env, free_port, server_argv, stop
from vllm_exl3.dev import family_oracle, golden_logprobs
from vllm_exl3.format.families.glm4_moe_lite import mla_kernels_take

pytestmark = pytest.mark.e2e

FAMILIES = Path(__file__).resolve().parents[1] / "fixtures" / "exl3-families"
TOKENIZER = FAMILIES / "mixtral-a-exl3-mul1-b4"
FP32 = ("--dtype", "float32", "--enforce-eager")
BF16 = ("--dtype", "bfloat16", "--enforce-eager")
HYBRID = ("Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM")  # gated delta net: bf16 only on vLLM's CPU build
TOP1, MEDIAN = 0.97, 0.05
HYBRID_GOLDEN_MARGIN = 0.1  # above the largest golden margin a bf16 server reversed (0.083 nats, docstring)

# Every ExLlamaV3-made fixture pack, with its goldens (PROVENANCE.md)
GOLDEN_PACKS = sorted(p.name for p in FAMILIES.iterdir() if (p / "golden" / "logits.safetensors").is_file())
# Held-out packs, not in the repository: ExLlamaV3-made packs of these families at other geometries and bit widths
# (tools/exl3-packs, geometry b), each a folder with its golden/ beside the model, checked with the same bounds when
# this variable names the folder that holds them (docs/packs.md "Checking a pack against ExLlamaV3").
HELD_OUT = Path(os.environ.get("VLLM_EXL3_HELD_OUT_PACKS", "")) if os.environ.get("VLLM_EXL3_HELD_OUT_PACKS") else None


def _held_out_packs() -> list[str]:
    """The packs under HELD_OUT; a folder named but missing or holding none is a mistake, not a pass."""
    if HELD_OUT is None:
        return []
    packs = sorted(p.name for p in HELD_OUT.iterdir() if (p / "golden" / "logits.safetensors").is_file()) \
        if HELD_OUT.is_dir() else []
    if not packs:
        pytest.fail(f"VLLM_EXL3_HELD_OUT_PACKS={HELD_OUT}: no pack folder with golden/logits.safetensors there "
                    "(docs/packs.md \"Checking a pack against ExLlamaV3\")", pytrace=False)
    return packs


HELD_OUT_PACKS = _held_out_packs()


def _server_env(pack: Path) -> dict[str, str]:
    """cpu_env; for Qwen3.5 on a machine without torchvision the import stand-in of support/qwen3_vl_imports; for an
    MLA latent other than the 576 vLLM's MLA takes (the GLM-4.7-Flash fixtures' 160), vLLM's per-head attention."""
    config = json.loads((pack / "config.json").read_text())
    extra = {}
    if config["architectures"][0].startswith("Qwen3_5") and qwen3_vl.needed():
        extra["PYTHONPATH"] = qwen3_vl.pythonpath()
    if not mla_kernels_take(config):
        extra["VLLM_MLA_DISABLE"] = "1"
    return cpu_env(**extra)


# vLLM's CPU rotary op mis-rotates a [tokens, heads, dim] query, which its MLA attention (GLM-4.7-Flash) hands it:
# torch's own rotary instead (docs/vllm-notes.md).
NATIVE_ROPE = ("--compilation-config", '{"custom_ops": ["all", "-rotary_embedding"]}')


def _options(architecture: str, against_goldens: bool = False) -> tuple[tuple[str, ...], float]:
    """The server's options and the top-2 margin below which a position is not counted (the module docstring
    says why a bf16 server against ExLlamaV3's fp16 goldens needs the wider one)."""
    if architecture in HYBRID:
        return BF16, HYBRID_GOLDEN_MARGIN if against_goldens else golden_logprobs.BF16_MARGIN
    return FP32 + (NATIVE_ROPE if architecture == "Glm4MoeLiteForCausalLM" else ()), 0.0


def _check(report: golden_logprobs.ParityReport, architecture: str) -> None:
    assert report.top1_agreement >= (golden_logprobs.BF16_TOP1 if architecture in HYBRID else TOP1), report
    assert report.median_abs_logprob_delta <= MEDIAN, report


def _architecture(pack: Path) -> str:
    return json.loads((pack / "config.json").read_text())["architectures"][0]


@pytest.fixture(scope="module")
def oracle_packs(tmp_path_factory):
    """architecture -> (pack, input ids, transformers' logits), made once each."""
    made = {}

    def make(arch: str):
        if arch not in made:
            pack = family_oracle.oracle_fixture(arch, tmp_path_factory.mktemp(arch), TOKENIZER)
            golden = load_file(pack / "golden" / "logits.safetensors")
            made[arch] = pack, golden["input_ids"], golden["logits"]
        return made[arch]

    return make


# The single-rank cases, in the order of the tests below: each boots beside the next one not yet done (two servers
# side by side, one boot's wait on a 2-core box). The tensor-parallel ones boot alone.
PAIRED = ([("golden", name) for name in GOLDEN_PACKS] + [("oracle", a) for a in family_oracle.ORACLE_ARCHITECTURES]
          + [("held-out", name) for name in HELD_OUT_PACKS])


@pytest.fixture(scope="module")
def agreements(oracle_packs, tmp_path_factory):
    """(kind, name) -> the server's golden_logprobs.ParityReport against its oracle: ("golden", pack) ExLlamaV3's
    goldens, ("held-out", pack) the same for a pack under HELD_OUT, ("oracle", architecture) transformers',
    ("tp2", architecture) transformers' at -tp 2."""

    def spec(key):
        kind, name = key
        if kind in ("golden", "held-out"):
            pack = (FAMILIES if kind == "golden" else HELD_OUT) / name
            golden = load_file(pack / "golden" / "logits.safetensors")
            ids, logits, extra = golden["input_ids"], golden["logits"], ()
        else:
            (pack, ids, logits), extra = oracle_packs(name), (("-tp", "2") if kind == "tp2" else ())
        options, margin = _options(_architecture(pack), against_goldens=kind in ("golden", "held-out"))
        return (pack, tmp_path_factory.mktemp("server"), (*options, *extra), _server_env(pack)), (ids, logits, margin)

    def measure(key, server, context):
        ids, logits, margin = context
        return golden_logprobs.compare(server.base_url, server.model, ids, logits, margin)

    return SideBySide(PAIRED, spec, measure)


@pytest.mark.parametrize("name", GOLDEN_PACKS)
def test_exllamav3_pack_matches_exllamav3(name, agreements):
    _check(agreements(("golden", name)), _architecture(FAMILIES / name))


@pytest.mark.parametrize("name", HELD_OUT_PACKS)
def test_held_out_exllamav3_pack_matches_exllamav3(name, agreements):
    _check(agreements(("held-out", name)), _architecture(HELD_OUT / name))


@pytest.mark.parametrize("arch", family_oracle.ORACLE_ARCHITECTURES)
def test_plugin_matches_transformers(arch, agreements):
    _check(agreements(("oracle", arch)), arch)


@pytest.mark.parametrize("arch", ["GptOssForCausalLM", "Qwen3NextForCausalLM"])
def test_tensor_parallel_two_matches_transformers(arch, agreements):
    """The two-Spark profile's split: gpt-oss's experts with biases (the down projection's added once) and its
    vocab-parallel EXL3 head; Qwen3-Next's in_proj_qkvz by key-head groups and its gated attention's heads."""
    _check(agreements(("tp2", arch)), arch)


def test_plain_vllm_serve_refuses_a_config_vllm_would_not_follow(tmp_path):
    """transformers' default rms_norm_eps for gpt-oss (1e-6) is one vLLM's GptOss ignores (it uses 1e-5): plain
    `vllm serve` stops while building its config, naming the key, before any weight is read."""
    pack = tmp_path / "gptoss"
    shutil.copytree(FAMILIES / "gptoss-a-exl3-mul1-b4", pack, ignore=shutil.ignore_patterns("golden"))
    config = json.loads((pack / "config.json").read_text())
    (pack / "config.json").write_text(json.dumps(dict(config, rms_norm_eps=1e-6)))
    proc = subprocess.Popen(server_argv(pack, free_port(), *FP32), env=cpu_env(), text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, start_new_session=True)
    try:
        out = proc.communicate(timeout=BOOT_TIMEOUT_S)[0]
    except subprocess.TimeoutExpired:  # it booted: the refusal did not happen
        stop(proc)
        out = proc.communicate()[0]
    assert proc.returncode != 0, out[-3000:]
    assert "expected rms_norm_eps one of 1e-05" in out and "cannot be served" in out, out[-3000:]
    assert "Loading weights" not in out
