"""Serve every fixture pack with vLLM's CPU build through the plugin and measure prompt-logprob parity with the
golden logits ExLlamaV3 computed from the same pack. Writes bench/results/cpu-vllm-parity.json.

Run from the repository root with the dev environment: `.venv/bin/python bench/parity_cpu.py`.
"""

from __future__ import annotations

import json
import sys
import tempfile
from dataclasses import asdict
from pathlib import Path

from safetensors.torch import load_file

root = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(root / "tests"))

from support.servers import vllm_server  # noqa: E402

from vllm_exl3.dev import golden_logprobs  # noqa: E402

FIXTURES = root / "tests" / "fixtures" / "exl3"


def main() -> None:
    import vllm

    rows = {}
    with tempfile.TemporaryDirectory() as logs:
        for pack in sorted(p for p in FIXTURES.iterdir() if (p / "golden").is_dir()):
            golden = load_file(pack / "golden" / "logits.safetensors")
            with vllm_server(pack, Path(logs), "--dtype", "float32", "--enforce-eager") as server:
                report = golden_logprobs.compare(server.base_url, server.model, golden["input_ids"], golden["logits"])
            rows[pack.name] = asdict(report)
            print(f"{pack.name:28s} top-1 {report.top1_agreement:6.1%}  median |dlogp| "
                  f"{report.median_abs_logprob_delta:.5f}  max {report.max_abs_logprob_delta:.4f}")
    out = root / "bench" / "results" / "cpu-vllm-parity.json"
    out.write_text(json.dumps({"vllm": vllm.__version__, "dtype": "float32", "kernel": "torch",
                               "reference": "ExLlamaV3 1.6.5 logits (tests/fixtures/exl3/*/golden)",
                               "packs": rows}, indent=2) + "\n")
    print(f"-> {out}")


if __name__ == "__main__":
    main()
