"""The model classes the plugin registers over vLLM's (integration/models.py): vLLM's registry resolves the
architecture to ours, which is vLLM's class underneath (same interfaces, so the same scheduling, state and parallel
support). That they serve packs is the end-to-end tests' business."""

from __future__ import annotations

from dataclasses import asdict

import pytest
from support import qwen3_vl

vllm = pytest.importorskip("vllm")

import vllm_exl3  # noqa: E402

vllm_exl3.register()

from vllm import ModelRegistry  # noqa: E402
from vllm.model_executor.models.registry import _VLLM_MODELS, _ModelInfo  # noqa: E402
from vllm_exl3.integration.register import MODEL_OVERRIDES  # noqa: E402


def qwen3_vl_imports(monkeypatch) -> None:
    """vLLM's qwen3_5 modules import torchvision through transformers' Qwen2-VL image processor: where torchvision
    does not import (the CPU test machine), the stand-in the e2e servers get (tests/support/qwen3_vl_imports), for
    this test only."""
    import importlib.util
    import sys

    if qwen3_vl.needed():
        monkeypatch.setattr(sys, "meta_path", list(sys.meta_path))  # the stand-in's finder leaves with the test
        spec = importlib.util.spec_from_file_location("qwen3_vl_imports_stand_in",
                                                      qwen3_vl.STAND_IN / "sitecustomize.py")
        spec.loader.exec_module(importlib.util.module_from_spec(spec))


@pytest.mark.parametrize("arch", sorted(MODEL_OVERRIDES))
def test_architecture_resolves_to_the_plugins_subclass_of_vllms(arch, monkeypatch):
    import importlib

    if arch.startswith("Qwen3_5"):
        qwen3_vl_imports(monkeypatch)
    ours = ModelRegistry.models[arch].load_model_cls()
    module, _, name = MODEL_OVERRIDES[arch].partition(":")
    assert ours is getattr(importlib.import_module(module), name)
    module, name = _VLLM_MODELS[arch]  # vLLM's own (module, class) for the architecture (GLM's MTP: Glm4MoeMTP)
    vllms = next(c for c in ours.__mro__[1:] if c.__module__.startswith("vllm.model_executor.models."))
    assert (vllms.__module__, vllms.__name__) == (f"vllm.model_executor.models.{module}", name)
    # what vLLM reads off the class (hybrid, PP, MoE, ... support) is vLLM's; `architecture` is the class name, which
    # vLLM compares only with its Transformers-backend class (ModelConfig.using_transformers_backend)
    info = {k: v for k, v in asdict(_ModelInfo.from_model_cls(ours)).items() if k != "architecture"}
    assert info == {k: v for k, v in asdict(_ModelInfo.from_model_cls(vllms)).items() if k != "architecture"}
