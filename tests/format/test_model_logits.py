"""Whole-model check: the dequantized pack, run by transformers' own model classes in fp32, reproduces the
logits ExLlamaV3 computed from the same pack (golden/logits.safetensors)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from support.packs import dequantized_checkpoint
from vllm_exl3.format import dequant
from vllm_exl3.format.pack import Pack

transformers = pytest.importorskip("transformers")


def test_logits_match_exllamav3(fixture_pack, tmp_path):
    golden = load_file(fixture_pack / "golden" / "logits.safetensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(
        dequantized_checkpoint(fixture_pack, tmp_path), dtype=torch.float32)
    model.eval()
    with torch.no_grad():
        logits = model(golden["input_ids"]).logits
    expected = golden["logits"]
    rel = ((logits - expected).norm() / expected.norm()).item()
    agree = (logits.argmax(-1) == expected.argmax(-1)).float().mean().item()
    assert rel <= 2e-2, rel
    assert agree >= 0.97, agree


def test_unquantized_head_with_padded_input_columns(tmp_path):
    """A pack whose head is stored plain with ExLlamaV3's padded input columns ([vocab, hidden + pad]): the
    checkpoint helper keeps the first `hidden` columns, and the model still reproduces the goldens."""
    import shutil

    from support.fixtures import pack_dir

    src = pack_dir("qwen3moe-a-exl3-mul1-b4")
    pack = tmp_path / "plain-head"
    shutil.copytree(src, pack, ignore=shutil.ignore_patterns("quantization_config.json"))
    items = [i for i in dequant.plan(Pack.open(src), None, rotated=False, padded=False) if i.linear.prefix == "lm_head"]
    dequant.write(items, tmp_path / "head.safetensors", rotated=False)
    head = load_file(tmp_path / "head.safetensors")["lm_head.weight"]
    tensors = load_file(pack / "model.safetensors")
    for suffix in [k.rpartition(".")[2] for k in tensors if k.startswith("lm_head.")]:
        del tensors[f"lm_head.{suffix}"]
    junk = torch.randn(head.shape[0], 128, generator=torch.Generator().manual_seed(0)).to(head.dtype)
    tensors["lm_head.weight"] = torch.cat([head, junk], dim=1)
    save_file(tensors, str(pack / "model.safetensors"), metadata={"format": "pt"})
    (tmp_path / "out").mkdir()
    test_logits_match_exllamav3(pack, tmp_path / "out")
