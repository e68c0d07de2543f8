"""The interface every kernel backend implements, and the table the backend modules add themselves to on import
(`register_backend`). Backend modules import this module only; backend.py imports them (no cycle)."""

from __future__ import annotations

import torch

from ..format.tensors import Exl3Weights
from .specs import ExpertStack, LinearSpec, MoESpec


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

    def prepare_linear(self, w: Exl3Weights) -> torch.Tensor:
        """Once per layer after loading: any derived tensor the backend wants (a decoded cache, a repacked
        trellis). Returned tensor is kept on the layer and handed back to `linear`; empty when unused."""
        return torch.empty(0, device=w.trellis.device)

    def linear(self, x: torch.Tensor, w: Exl3Weights, prepared: torch.Tensor, in_offset: int, out_offset: int,
               out_features: int) -> torch.Tensor:
        """y = x·W for a layer stored as the 128-aligned block range around its logical slice.

        x: [M, in] in the activation dtype, placed at columns [in_offset, in_offset + in) of a zero input of
        width w.in_padded; returns [M, out_features] = columns [out_offset, out_offset + out_features) of the
        output, in x's dtype, without bias. Must not sync the host or allocate by tensor *values* (CUDA graphs).
        """
        raise NotImplementedError

    # -- routed experts -----------------------------------------------------------------------------------
    def moe_unsupported_reason(self, spec: MoESpec) -> str | None:
        return "routed experts not implemented"

    def prepare_moe(self, experts: ExpertStack, top_k: int | None = None, max_tokens: int | None = None,
                    activation: str | None = None) -> list[torch.Tensor]:
        """Once per layer after loading (tensors kept on the layer and handed back to `moe`). top_k and
        max_tokens (vLLM's batched-token budget), when known, let a backend reserve its workspace now, before
        CUDA-graph capture; a backend whose kernels are built per activation needs `activation` here too."""
        return []

    def moe(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            expert_map: torch.Tensor | None, experts: ExpertStack, prepared: list[torch.Tensor], activation: str,
            router_weight_on_input: bool) -> torch.Tensor:
        """Σ_k w_k · expert_{id_k}(x) over the experts local to this rank, [M, H] in x's dtype.

        topk_ids are global expert ids; `expert_map` (global -> local, -1 elsewhere) is given under expert
        parallelism. With `router_weight_on_input` (top-1 models) x is scaled before the experts instead."""
        raise NotImplementedError


REGISTRY: dict[str, Backend] = {}  # name -> backend, filled by the backend modules as backend.py imports them


def register_backend(backend: Backend) -> Backend:
    REGISTRY[backend.name] = backend
    return backend
