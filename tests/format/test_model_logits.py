"""Whole-model check: the dequantized pack, run by transformers' own model classes in fp32, reproduces the
logits ExLlamaV3 computed from the same pack (golden/logits.safetensors)."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file, save_file

from vllm_exl3.format import dequant
from vllm_exl3.format.pack import Pack
from vllm_exl3.format.tensors import read_tensor

transformers = pytest.importorskip("transformers")


def dequantized_checkpoint(pack_root, out_dir):
    pack = Pack.open(pack_root)
    weights_file = out_dir / "dequant.safetensors"
    dequant.write(dequant.plan(pack, None, rotated=False, padded=False), weights_file, rotated=False)
    tensors = load_file(weights_file)
    weights_file.unlink()
    hidden = pack.text_config["hidden_size"]
    for name, rec in pack.unquantized().items():
        t = read_tensor(rec)
        if name == "lm_head.weight":
            t = t[:, :hidden]  # an unquantized head keeps the padded input columns (docs/format.md §5.2)
        tensors[name] = t
    save_file(tensors, str(out_dir / "model.safetensors"))
    config = dict(pack.config)
    config.pop("quantization_config")
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir


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
