"""The transformers-oracle packs of the MoE families (dev/family_oracle.py), made here on the CPU for the GPU
harness's families step: one folder per architecture under OUT (default .vgpu/oracle), each a pack with its
`golden/logits.safetensors` as the fixtures hold theirs. The device call carries OUT.

    .venv/bin/python bench/gpu/oracle_packs.py [OUT] [ARCHITECTURE ...]
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


def main(argv: list[str]) -> int:
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
