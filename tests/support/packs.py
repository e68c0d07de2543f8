"""Model directories made from the fixture packs for the pack-tool tests (copies in tmp, never the fixtures)."""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from safetensors.torch import load_file, save_file

from vllm_exl3.format import dequant
from vllm_exl3.format.pack import Pack, tensor_group
from vllm_exl3.format.tensors import read_tensor


def copy_pack(src: Path, dst: Path) -> Path:
    shutil.copytree(src, dst, ignore=shutil.ignore_patterns("golden"))
    return dst


def dequantized_model(src: Path, dst: Path) -> Path:
    """A plain (unquantized, fp32) model of the same architecture: every EXL3 linear decoded to `.weight`, the
    routed experts in one shard and everything else in another (with an index), no quantization_config."""
    pack = Pack.open(src)
    dst.mkdir(parents=True)
    items = dequant.plan(pack, None, rotated=False, padded=False)
    experts = [it for it in items if tensor_group(it.linear.prefix) == "experts"]
    dense = [it for it in items if tensor_group(it.linear.prefix) != "experts"]
    dequant.write(experts, dst / "model-00001-of-00002.safetensors", rotated=False)
    dequant.write(dense, dst / "dense.tmp", rotated=False)
    tensors = load_file(dst / "dense.tmp")
    tensors.update({n: read_tensor(r) for n, r in pack.unquantized().items()})
    save_file(tensors, dst / "model-00002-of-00002.safetensors", metadata={"format": "pt"})
    (dst / "dense.tmp").unlink()
    config = dict(pack.config)
    config.pop("quantization_config", None)
    (dst / "config.json").write_text(json.dumps(config, indent=2))
    for f in src.iterdir():
        if f.is_file() and f.name.startswith(("tokenizer", "generation")):
            shutil.copy(f, dst / f.name)
    from vllm_exl3.format import packtools

    packtools.write_index(dst, *packtools.scan_shards(dst))
    return dst


def dequantized_checkpoint(pack_root: Path, out_dir: Path) -> Path:
    """A transformers checkpoint (one file, fp32 weights in the original basis) of a pack, for whole-model checks
    against the golden logits (tests/format/test_model_logits.py and its GPU twin)."""
    pack = Pack.open(pack_root)
    weights_file = out_dir / "dequant.safetensors"
    dequant.write(dequant.plan(pack, None, rotated=False, padded=False), weights_file, rotated=False)
    tensors = load_file(weights_file)
    weights_file.unlink()
    hidden = pack.text_config["hidden_size"]
    for name, rec in pack.unquantized().items():
        t = read_tensor(rec)
        if name == "lm_head.weight":
            # an unquantized head keeps the padded input columns (docs/format.md §5.2); safetensors saves only
            # contiguous tensors, and the slice is a strided view
            t = t[:, :hidden].contiguous()
        tensors[name] = t
    save_file(tensors, str(out_dir / "model.safetensors"))
    config = dict(pack.config)
    config.pop("quantization_config")
    (out_dir / "config.json").write_text(json.dumps(config))
    return out_dir
