"""The interface every kernel backend implements, and the table the backend modules add themselves to on import
(`register_backend`). A backend binds each layer once at load (`bind_linear`, `bind_moe`): the bound object holds
everything the layer's calls need and is what kernels/ops.py runs. Backend modules import this module only;
backend.py imports them (no cycle)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..format.tensors import Exl3Weights
from .specs import SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT, ExpertStack, LinearSpec, MoESpec


@dataclass(frozen=True)
class MoECall:
    """How a routed-experts layer is called, fixed when it is bound: its gated activation (with swigluoai's clamp
    and alpha), whether the router weight scales the input (top-1 models) instead of the output, and, when known,
    its top-k and vLLM's batched-token budget (a backend may reserve its workspace from them before CUDA-graph
    capture)."""

    activation: str
    router_weight_on_input: bool = False
    top_k: int | None = None
    max_tokens: int | None = None
    limit: float | None = None  # swigluoai's clamp (specs.ACTIVATIONS)
    alpha: float | None = None  # swigluoai's sigmoid scale

    @property
    def clamp(self) -> tuple[float, float]:
        """swigluoai's (limit, alpha), the model's defaults where the call names none."""
        return (SWIGLUOAI_LIMIT if self.limit is None else self.limit,
                SWIGLUOAI_ALPHA if self.alpha is None else self.alpha)


class BoundLinear:
    """One dense EXL3 linear bound to a backend: everything its calls need, made once at load (`Backend.bind_linear`).

    `self(x)`: x [M, in] in the activation dtype, placed at columns [in_offset, in_offset + in) of a zero input of
    width w.in_padded; returns [M, out_features] = columns [out_offset, out_offset + out_features) of the output, in
    x's dtype, without bias. Must not sync the host or allocate by tensor *values* (CUDA graphs)."""

    backend = "?"
    op = "linear"

    def __init__(self, w: Exl3Weights, in_offset: int, out_offset: int, out_features: int):
        self.w, self.in_offset, self.out_offset, self.out_features = w, in_offset, out_offset, out_features

    @property
    def handle(self) -> torch.Tensor:
        """The tensor the `vllm_exl3::linear` op receives for this layer (kernels/ops.py finds the binding by it)."""
        return self.w.trellis

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class BoundLinearGroup:
    """2..4 whole dense linears of one input bound together (attention q, k, v): one call computes them all, made
    once at load (`Backend.bind_linear_group`) from the shards' own bindings, each already gated on its own.

    `self(x)`: x [M, in_padded] (every shard's whole, unsliced input) -> [M, Σ out_padded], the shards' outputs
    side by side in `ws` order, in x's dtype. The same CUDA-graph rules as BoundLinear."""

    backend = "?"
    op = "linear_group"

    def __init__(self, shards: list[BoundLinear]):
        self.shards = shards
        self.out_features = sum(s.w.out_padded for s in shards)

    @property
    def ws(self) -> list[Exl3Weights]:
        return [s.w for s in self.shards]

    @property
    def handle(self) -> torch.Tensor:
        """The tensor the `vllm_exl3::linear_group` op receives: the first shard's trellis (kernels/ops.py keys
        bindings by op as well, so this group and that shard's own BoundLinear do not collide)."""
        return self.ws[0].trellis

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError


class SideBySideLinearGroup(BoundLinearGroup):
    """The shards' own bindings called in turn, their outputs side by side: one op for a layer of several EXL3
    linears where no grouped kernel takes them (another backend, other codebooks or widths, a rank's slices), and the
    torch reference's grouped call. Each shard may be sliced (its own in/out offsets): the output is [M, Σ
    out_features]. No kernel of its own, so nothing new to gate: each shard was gated when it was bound.

    Why one op and not a `torch.cat` of the shards' ops in the model's graph: the model splits that output again, and
    Inductor then hands a split that crosses one of vLLM's graph pieces (Qwen3.5's delta-net `z`, a view of
    `in_proj_qkvz`) to the next piece with other strides than it was traced with, which vLLM's compiled graph
    asserts (bench/notes/serving-run-11.md, the exllamav3 Qwen3.5 row)."""

    def __init__(self, shards: list[BoundLinear]):
        super().__init__(shards)
        self.out_features = sum(s.out_features for s in shards)
        self.backend = "+".join(sorted({s.backend for s in shards}))

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        return torch.cat([shard(x) for shard in self.shards], dim=-1)


class BoundMoE:
    """One routed-experts layer bound to a backend, made once at load (`Backend.bind_moe`).

    `self(x, topk_weights, topk_ids, expert_map)`: Σ_k w_k · expert_{id_k}(x) over the experts local to this rank,
    [M, H] in x's dtype. topk_ids are global expert ids; `expert_map` (global -> local, -1 elsewhere) is given under
    expert parallelism, else None. With `call.router_weight_on_input` x is scaled before the experts instead."""

    backend = "?"
    op = "moe"

    def __init__(self, experts: ExpertStack, call: MoECall):
        self.experts, self.call = experts, call

    @property
    def handle(self) -> torch.Tensor:
        """The tensor the `vllm_exl3::moe` op receives for this layer (kernels/ops.py finds the binding by it)."""
        return self.experts.w13_trellis

    def __call__(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
                 expert_map: torch.Tensor | None) -> torch.Tensor:
        raise NotImplementedError


class Backend:
    """A kernel backend. Subclasses override what they implement; a `None` reason means "yes"."""

    name = "?"

    def unavailable_reason(self) -> str | None:
        return None

    def build_id(self) -> str:
        """What identifies this backend's kernels beyond the plugin's version (a library build, a dependency's
        version): part of the torch.compile cache key (integration/compile_key.py)."""
        return ""

    # -- dense linears ------------------------------------------------------------------------------------
    def linear_unsupported_reason(self, spec: LinearSpec) -> str | None:
        return "dense linears not implemented"

    def bind_linear(self, w: Exl3Weights, in_offset: int, out_offset: int, out_features: int) -> BoundLinear:
        """Once per layer after loading: a layer stored as the 128-aligned block range around its logical slice,
        bound with whatever the backend derives from it (a decoded cache, a built module, its call's arguments)."""
        raise NotImplementedError(f"the {self.name} backend has no dense linears")

    def linear_group_unsupported_reason(self, spec: LinearSpec, shards: int) -> str | None:
        """`spec`: one shard's geometry (every shard shares it but for out_padded, here their sum)."""
        return "no grouped linears"

    def bind_linear_group(self, shards: list[BoundLinear]) -> BoundLinearGroup:
        """Once per layer after its shards were bound to this backend (`shards`: their bindings, each a whole linear:
        no offsets, every output column): one call for all of them."""
        raise NotImplementedError(f"the {self.name} backend has no grouped linears")

    # -- a MoE router's gate: a 16-bit linear, not EXL3 ------------------------------------------------------
    def router_gate_unsupported_reason(self, dtype: torch.dtype, in_features: int) -> str | None:
        return "no router gate kernel"

    def router_gate(self, x: torch.Tensor, weight: torch.Tensor, out_fp32: bool) -> torch.Tensor:
        """Router logits x [M, in] · weight [experts, in]^T: fp32 with `out_fp32` (what vLLM's router takes), else
        in x's dtype. Called from inside vLLM's compiled graphs, so any choice by M happens inside an op (a branch
        in traced Python would be frozen at the first trace). The same CUDA-graph rules as BoundLinear."""
        raise NotImplementedError(f"the {self.name} backend has no router gate kernel")

    # -- routed experts -----------------------------------------------------------------------------------
    def moe_unsupported_reason(self, spec: MoESpec) -> str | None:
        return "routed experts not implemented"

    def bind_moe(self, experts: ExpertStack, call: MoECall) -> BoundMoE:
        """Once per layer after loading: the layer's experts bound with what the backend derives from them (key
        tables, a built module, a workspace reserved before CUDA-graph capture)."""
        raise NotImplementedError(f"the {self.name} backend has no routed experts")


REGISTRY: dict[str, Backend] = {}  # name -> backend, filled by the backend modules as backend.py imports them


def register_backend(backend: Backend) -> Backend:
    REGISTRY[backend.name] = backend
    return backend
