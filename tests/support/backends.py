"""Silently wrong kernel backends, what the parity gate (kernels/parity.py) exists to catch: the torch reference
10 % off, registered under the name `native` and always available (WrongNative: every layer; WrongGroupNative: only
its grouped linears). Tests put one into kernels.backend.REGISTRY."""

from __future__ import annotations

from vllm_exl3.kernels.backends.torch_ref import TorchBackend, TorchLinear, TorchLinearGroup, TorchMoE


class WrongLinear(TorchLinear):
    backend = "native"

    def __call__(self, x):
        return 1.1 * super().__call__(x)


class WrongMoE(TorchMoE):
    backend = "native"

    def __call__(self, *args):
        return 1.1 * super().__call__(*args)


class WrongNative(TorchBackend):
    name = "native"

    def unavailable_reason(self):
        return None

    def bind_linear(self, w, in_offset, out_offset, out_features):
        return WrongLinear(w, in_offset, out_offset, out_features)

    def bind_moe(self, experts, call):
        return WrongMoE(experts, call)


class RightLinear(TorchLinear):
    backend = "native"


class WrongGroup(TorchLinearGroup):
    backend = "native"

    def __call__(self, x):
        return 1.1 * super().__call__(x)


class WrongGroupNative(TorchBackend):
    name = "native"

    def unavailable_reason(self):
        return None

    def bind_linear(self, w, in_offset, out_offset, out_features):
        return RightLinear(w, in_offset, out_offset, out_features)

    def bind_linear_group(self, ws):
        return WrongGroup(ws)
