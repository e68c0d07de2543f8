"""Lets vLLM's qwen3_5 model module import on the CPU test machine, which has no usable torchvision.

vLLM's qwen3_5.py imports qwen3_vl.py, which imports `smart_resize` from transformers'
`models.qwen2_vl.image_processing_qwen2_vl`, a module that imports torchvision at its top. The CPU build of
torchvision (0.28.0+cpu) is on PyTorch's own index only, which this machine cannot reach; PyPI's torchvision is the
CUDA build and does not import beside CPU torch (docs/vllm-notes.md §8). transformers' PIL variant of the same module
defines the same `smart_resize` without torchvision: this finder serves it under the torchvision module's name.
Nothing of it runs for a text-only model; a machine with torchvision (a user's, the GPU image) never needs this.
tests/support/qwen3_vl.py puts this folder on the PYTHONPATH of a process that imports Qwen3.5's modules (a server,
vLLM's model inspection), when torchvision does not import."""

import importlib.abc
import importlib.util
import sys

_ALIASES = {"transformers.models.qwen2_vl.image_processing_qwen2_vl":
            "transformers.models.qwen2_vl.image_processing_pil_qwen2_vl"}


class _AliasFinder(importlib.abc.MetaPathFinder, importlib.abc.Loader):
    def find_spec(self, name, path=None, target=None):
        return importlib.util.spec_from_loader(name, self) if name in _ALIASES else None

    def create_module(self, spec):
        return importlib.import_module(_ALIASES[spec.name])

    def exec_module(self, module):
        pass


sys.meta_path.insert(0, _AliasFinder())
