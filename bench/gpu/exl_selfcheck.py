"""ExLlamaV3 against its own golden logits: how far its own forward moves when only the batch shape or its linear
path changes. This is the noise floor of the families step's bound (top-1 and median |Δ log p| against the goldens)
for one pack on ExLlamaV3's own kernels.

The goldens (`golden/logits.safetensors`, `../shared/tools/exl3-packs/golden.py`) are ExLlamaV3's forward over all
prompts at once. The served check (`vllm_exl3.dev.golden_logprobs`) sends one prompt at a time, so ExLlamaV3's
kernels see other row counts there. Variants, each scored like the served check:

- `batch`: the goldens' own call (all prompts, one forward): should reproduce them;
- `per-prompt`: one prompt per forward (the served check's row counts);
- `per-prompt-reconstruct`: the same with every linear reconstructed to fp16 and multiplied by torch
  (`params["reconstruct"]`, ExLlamaV3's prefill path above its row threshold).

    PYTHONPATH=<ExLlamaV3's extension>:... python3 bench/gpu/exl_selfcheck.py PACK [PACK ...]   (one JSON line each)
"""

from __future__ import annotations

import json
import statistics
import sys
from pathlib import Path

import torch

MIN_TOP2_MARGIN = 0.004  # bench/gpu/plan.toml [families] min-top2-margin: the served check's rule


def score(golden: torch.Tensor, got: torch.Tensor) -> dict:
    """golden, got: [B, T, V] logits. The served check's metrics, plus the positions whose argmax moved."""
    ref = golden.double().log_softmax(-1)
    out = got.double().log_softmax(-1)
    ranked = agree = 0
    deltas, moved = [], []
    for b in range(ref.shape[0]):
        for t in range(ref.shape[1]):
            top2 = ref[b, t].topk(2).values
            best = int(ref[b, t].argmax())
            margin = float(top2[0] - top2[1])
            if margin > MIN_TOP2_MARGIN:
                ranked += 1
                ok = int(out[b, t].argmax()) == best
                agree += ok
                if not ok:
                    moved.append({"prompt": b, "position": t, "golden_margin": round(margin, 5)})
            deltas.append(abs(float(out[b, t, best] - ref[b, t, best])))
    return {"ranked": ranked, "top1_agreement": agree / max(ranked, 1),
            "median_abs_logprob_delta": statistics.median(deltas), "max_abs_logprob_delta": max(deltas),
            "moved": moved}


def check(pack: Path) -> dict:
    from exllamav3 import Config, Model
    from safetensors.torch import load_file

    golden = load_file(pack / "golden" / "logits.safetensors")
    ids, logits = golden["input_ids"], golden["logits"]
    model = Model.from_config(Config.from_directory(str(pack)))
    model.load("cuda:0")
    base = {"attn_mode": "flash_attn_nc"}
    result = {"pack": pack.name, "gpu": torch.cuda.get_device_name(0), "prompts": list(ids.shape), "variants": {}}
    with torch.inference_mode():
        variants = {
            "batch": lambda: model.forward(ids, dict(base)).float().cpu(),
            "per-prompt": lambda: torch.cat([model.forward(ids[i:i + 1], dict(base)).float().cpu()
                                             for i in range(ids.shape[0])]),
            "per-prompt-reconstruct": lambda: torch.cat([
                model.forward(ids[i:i + 1], {**base, "reconstruct": True}).float().cpu()
                for i in range(ids.shape[0])]),
        }
        for name, run in variants.items():
            try:
                result["variants"][name] = score(logits, run())
            except Exception as e:  # one variant failing must not hide the others
                result["variants"][name] = {"error": f"{type(e).__name__}: {e}"[:500]}
    model.unload()
    return result


def main() -> int:
    for arg in sys.argv[1:]:
        try:
            print(json.dumps(check(Path(arg))), flush=True)
        except Exception as e:  # the next pack still runs
            print(json.dumps({"pack": Path(arg).name, "error": f"{type(e).__name__}: {e}"[:1000]}), flush=True)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
