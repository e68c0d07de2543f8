"""Whole model on the GPU: the fixture packs' tiny MoE models run by transformers' own model classes (fp16), with
every EXL3 linear replaced by a backend's dense op and every routed-experts block by its MoE op, reproduce the
logits ExLlamaV3 computed from the same pack (golden/logits.safetensors), within the CPU logits test's bounds
(tests/format/test_model_logits.py). Backends: native, and exllamav3 where the package is installed (skipped
otherwise, unless VLLM_EXL3_REQUIRE_EXLLAMAV3=1)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from support.gpu import native_or_skip, on_cuda

pytestmark = pytest.mark.gpu
native = native_or_skip()
transformers = pytest.importorskip("transformers")

from safetensors.torch import load_file  # noqa: E402

from vllm_exl3.dev.synthetic import expert_stack  # noqa: E402
from vllm_exl3.format.pack import Pack  # noqa: E402
from vllm_exl3.format.tensors import load_weights  # noqa: E402
from vllm_exl3.kernels.backend import get_backend  # noqa: E402
from vllm_exl3.kernels.interface import MoECall  # noqa: E402

from support.packs import dequantized_checkpoint  # noqa: E402

FIXTURES = Path(__file__).resolve().parents[2] / "fixtures" / "exl3"
PACKS = sorted(p.name for p in FIXTURES.iterdir() if (p / "golden" / "logits.safetensors").is_file())
DEV = "cuda"
PROJ = ("gate_proj", "up_proj", "down_proj")


class BackendLinear(torch.nn.Module):
    def __init__(self, backend, w, out_features):
        super().__init__()
        self.w, self.out_features = w, out_features
        self.bound = backend.bind_linear(w, 0, 0, out_features)

    def forward(self, x):
        shape = x.shape
        y = self.bound(x.reshape(-1, shape[-1]).contiguous())
        if self.w.bias is not None:
            y = y + self.w.bias.to(y.dtype)
        return y.reshape(*shape[:-1], self.out_features)


class BackendExperts(torch.nn.Module):
    """transformers' experts module contract: (hidden [T, H], top-k ids, top-k weights) -> [T, H]."""

    def __init__(self, backend, stack, top_k):
        super().__init__()
        self.bound = backend.bind_moe(stack, MoECall("silu", top_k=top_k, max_tokens=1024))

    def forward(self, hidden_states, top_k_index, top_k_weights):
        return self.bound(hidden_states.contiguous(), top_k_weights.float(), top_k_index, None)


def _replace(model, name, module):
    parent, _, child = name.rpartition(".")
    setattr(model.get_submodule(parent) if parent else model, child, module)


def backend_or_skip(name):
    backend = get_backend(name)
    if name == "exllamav3":
        from vllm_exl3.kernels.backends import exllamav3_moe

        if (why := backend.unavailable_reason() or exllamav3_moe.api_reason()) is not None:
            if os.environ.get("VLLM_EXL3_REQUIRE_EXLLAMAV3") == "1":
                raise RuntimeError(f"exllamav3 backend unavailable: {why}")
            pytest.skip(f"exllamav3 backend unavailable: {why}")
    return backend


@pytest.mark.parametrize("backend_name", ["native", "exllamav3"])
@pytest.mark.parametrize("pack", PACKS)
def test_logits_match_exllamav3_on_each_backend(pack, backend_name, tmp_path):
    backend = backend_or_skip(backend_name)
    root = FIXTURES / pack
    golden = load_file(root / "golden" / "logits.safetensors")
    model = transformers.AutoModelForCausalLM.from_pretrained(dequantized_checkpoint(root, tmp_path),
                                                              dtype=torch.float16).to(DEV).eval()
    linears = Pack.open(root).linears()
    experts: dict[str, dict[int, list]] = {}
    replaced = 0
    for name, lin in linears.items():
        head, sep, tail = name.partition(".experts.")
        if sep:  # model.layers.N.mlp.experts.E.gate_proj
            e, proj = tail.split(".")
            experts.setdefault(head + ".experts", {}).setdefault(int(e), [None] * 3)[PROJ.index(proj)] = \
                on_cuda(load_weights(lin))
            continue
        target = model.get_submodule(name)
        _replace(model, name, BackendLinear(backend, on_cuda(load_weights(lin)), target.out_features))
        replaced += 1
    top_k = model.config.num_experts_per_tok
    for name, per_expert in experts.items():
        weights = [per_expert[e] for e in sorted(per_expert)]
        _replace(model, name, BackendExperts(backend, expert_stack(weights, list(range(len(weights)))), top_k))
    assert replaced and experts, "nothing replaced: the test would compare the dequantized model with itself"
    with torch.no_grad():
        logits = model(golden["input_ids"].to(DEV)).logits.float().cpu()
    expected = golden["logits"].float()
    rel = ((logits - expected).norm() / expected.norm()).item()
    agree = (logits.argmax(-1) == expected.argmax(-1)).float().mean().item()
    print(f"{pack} on {backend_name}: rel {rel:.2e}, top-1 agreement {agree:.3f}")
    assert rel <= 2e-2, rel
    assert agree >= 0.97, agree
