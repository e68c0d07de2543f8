"""The transformers-oracle packs of the MoE families (dev/family_oracle.py), made here on the CPU for the GPU
harness's families step: one folder per architecture under OUT (default .vgpu/oracle), each a pack with its
`golden/logits.safetensors` as the fixtures hold theirs. The device call carries OUT.

    .venv/bin/python bench/gpu/oracle_packs.py [OUT] [ARCHITECTURE ...]
    .venv/bin/python bench/gpu/oracle_packs.py --unquantized OUT ARCHITECTURE ...

`--unquantized` writes, beside each pack already in OUT, `ARCHITECTURE-unquantized`: the pack's weights decoded
(family_oracle.decoded_checkpoint, in bf16) as a plain checkpoint with the pack's tokenizer and goldens. vLLM serves it with
its own layers and no quantization: the control that says how far vLLM itself lands from the fp32 goldens at the
dtype a family must run in (plan.toml [families] unquantized).
"""

from __future__ import annotations

import os
import shutil
import sys
import tempfile
import time
from pathlib import Path

from vllm_exl3.dev import family_oracle

ROOT = Path(__file__).resolve().parents[2]
TOKENIZER = Path(os.environ.get("ORACLE_TOKENIZER", ROOT / "tests" / "fixtures" / "exl3-families" / "mixtral-a-exl3-mul1-b4"))


def unquantized(out: Path, arch: str) -> Path:
    """In bf16, half the bytes of the decoded fp32 (one device call carries 64 MiB): the rounding vLLM's own cast
    to bf16 would make at load."""
    import torch
    from safetensors.torch import load_file, save_file

    pack, dest = out / arch, out / f"{arch}-unquantized"
    shutil.rmtree(dest, ignore_errors=True)
    family_oracle.decoded_checkpoint(pack, dest)
    weights = dest / "model.safetensors"
    save_file({n: t.to(torch.bfloat16) for n, t in load_file(weights).items()}, str(weights), metadata={"format": "pt"})
    for f in family_oracle.TOKENIZER_FILES:
        shutil.copy(pack / f, dest / f)
    shutil.copytree(pack / "golden", dest / "golden")
    return dest


def main(argv: list[str]) -> int:
    if argv[:1] == ["--unquantized"]:
        out = Path(argv[1])
        for arch in argv[2:]:
            dest = unquantized(out, arch)
            size = sum(f.stat().st_size for f in dest.rglob("*") if f.is_file())
            print(f"oracle_packs: {dest.name}: {size / 2**20:.1f} MiB", flush=True)
        return 0
    out = Path(argv[0]) if argv else ROOT / ".vgpu" / "oracle"
    for arch in argv[1:] or family_oracle.ORACLE_ARCHITECTURES:
        t = time.monotonic()
        with tempfile.TemporaryDirectory() as tmp:
            pack = family_oracle.oracle_fixture(arch, tmp, TOKENIZER)
            shutil.rmtree(out / arch, ignore_errors=True)
            shutil.copytree(pack, out / arch)
        size = sum(f.stat().st_size for f in (out / arch).rglob("*") if f.is_file())
        print(f"oracle_packs: {arch}: {size / 2**20:.1f} MiB in {time.monotonic() - t:.0f} s", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
