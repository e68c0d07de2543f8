"""A silently wrong kernel backend, what the parity gate (kernels/parity.py) exists to catch: the torch reference
10 % off, registered under the name `native` and always available. Tests put it into kernels.backend.REGISTRY."""

from __future__ import annotations

from vllm_exl3.kernels.backends.torch_ref import TorchBackend


class WrongNative(TorchBackend):
    name = "native"

    def unavailable_reason(self):
        return None

    def linear(self, x, w, prepared, in_offset, out_offset, out_features):
        return 1.1 * super().linear(x, w, prepared, in_offset, out_offset, out_features)

    def moe(self, *args):
        return 1.1 * super().moe(*args)
