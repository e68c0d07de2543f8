"""Stand-ins for the native backend, for the parity gate (kernels/parity.py): the torch reference registered under
the name `native` and always available, with some of its bindings silently wrong (10 % off), the output the gate
exists to catch. WrongNative: every binding; WrongGroupNative: only its grouped linears; WrongRouterGateNative: only its router gate. Tests put one into
kernels.backend.REGISTRY."""

from __future__ import annotations

from vllm_exl3.kernels.backends.torch_ref import TorchBackend, TorchLinear, TorchLinearGroup, TorchMoE


class RightLinear(TorchLinear):
    backend = "native"


class RightGroup(TorchLinearGroup):
    backend = "native"


class RightMoE(TorchMoE):
    backend = "native"


class _TenPercentOff:
    def __call__(self, *args):
        return 1.1 * super().__call__(*args)


class WrongLinear(_TenPercentOff, RightLinear):
    pass


class WrongGroup(_TenPercentOff, RightGroup):
    pass


class WrongMoE(_TenPercentOff, RightMoE):
    pass


class NativeStandIn(TorchBackend):
    """The torch reference as `native`; `linear`, `group` and `moe` say which binding classes it hands out."""

    name = "native"
    linear, group, moe = RightLinear, RightGroup, RightMoE

    def unavailable_reason(self):
        return None

    def bind_linear(self, w, in_offset, out_offset, out_features):
        return self.linear(w, in_offset, out_offset, out_features)

    def bind_linear_group(self, shards):
        return self.group(shards)

    def bind_moe(self, experts, call):
        return self.moe(experts, call)


class WrongNative(NativeStandIn):
    linear, group, moe = WrongLinear, WrongGroup, WrongMoE


class WrongGroupNative(NativeStandIn):
    group = WrongGroup


class WrongRouterGateNative(NativeStandIn):
    """Right EXL3 bindings, a router gate 10 % off."""

    def router_gate(self, x, weight, out_fp32):
        return 1.1 * super().router_gate(x, weight, out_fp32)
