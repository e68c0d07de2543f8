"""The EXL3 custom ops vLLM's graphs see, and the bindings they call.

A layer is bound once at load (`Backend.bind_linear` / `bind_moe`: its backend, codebooks, offsets, key tables and
workspace fixed then); `serve` makes that binding the one the ops run for the layer. A call then carries only the
activations, the routing and the layer's own packed trellis, by which the op finds the binding: no argument lists
are rebuilt and no names re-checked per call.

Why the trellis and not the layer's name (as vLLM's own `moe_forward(..., layer_name)` does): a name would be a
different constant in every layer's traced graph, and torch.compile would then compile each of the model's
identical layers on its own instead of reusing one compiled piece; the trellis is a graph input like any weight,
the same in every layer's graph, and unique to its layer while the layer lives. Bindings are held weakly: the layer
keeps its binding alive, so an unloaded model leaves nothing here, and a later one may reuse its addresses.

Each op has a fake (shape-only) implementation, so torch.compile traces through it and CUDA graphs capture
whatever kernel the binding launches inside.
"""

from __future__ import annotations

import threading
import weakref

import torch

from .interface import BoundLinear, BoundLinearGroup, BoundMoE

Bound = BoundLinear | BoundLinearGroup | BoundMoE
_lock = threading.Lock()
# (op, trellis address) -> binding: a grouped layer's first shard has its own `linear` binding at the same address
_serving: weakref.WeakValueDictionary[tuple[str, int], Bound] = weakref.WeakValueDictionary()


def serve(bound: Bound) -> None:
    """From now on the op `bound.op` runs `bound` for its layer (replacing an earlier binding of the same layer and
    op: a fallback)."""
    with _lock:
        _serving[(bound.op, bound.handle.data_ptr())] = bound


def serving(handle: torch.Tensor, op: str = BoundLinear.op) -> Bound | None:
    """The binding the op runs for the layer whose trellis is `handle`, None if no layer was served there."""
    with _lock:
        return _serving.get((op, handle.data_ptr()))


def _bound(handle: torch.Tensor, kind: type, op: str):
    bound = serving(handle, kind.op)
    if not isinstance(bound, kind):
        raise RuntimeError(f"vllm_exl3::{op}: no {kind.__name__} is served for a trellis of shape "
                           f"{list(handle.shape)} at {handle.data_ptr():#x} (the layer was not bound after loading)")
    return bound


@torch.library.custom_op("vllm_exl3::linear", mutates_args=())
def exl3_linear(x: torch.Tensor, trellis: torch.Tensor, out_features: int) -> torch.Tensor:
    """y [M, out_features] = x [M, in] · W of the layer whose packed trellis is `trellis`; see BoundLinear.
    Contiguous, as the fake says: a backend may hand back a column slice of its stored blocks (padded or sliced
    outputs), and a compiled graph (Inductor) reads the op's output with the fake's strides."""
    return _bound(trellis, BoundLinear, "linear")(x).contiguous()


@exl3_linear.register_fake
def _(x, trellis, out_features):
    return x.new_empty((x.shape[0], out_features))


@torch.library.custom_op("vllm_exl3::linear_group", mutates_args=())
def exl3_linear_group(x: torch.Tensor, trellis: torch.Tensor, out_features: int) -> torch.Tensor:
    """y [M, out_features] = the grouped linears whose first shard's trellis is `trellis`, side by side; see
    BoundLinearGroup."""
    return _bound(trellis, BoundLinearGroup, "linear_group")(x).contiguous()


@exl3_linear_group.register_fake
def _(x, trellis, out_features):
    return x.new_empty((x.shape[0], out_features))


@torch.library.custom_op("vllm_exl3::moe", mutates_args=())
def exl3_moe(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, expert_map: torch.Tensor | None,
             w13_trellis: torch.Tensor) -> torch.Tensor:
    """Routed experts of the layer whose gate/up trellis is `w13_trellis`: [M, H] local partial sum; see BoundMoE.
    `expert_map` is None without expert parallelism."""
    return _bound(w13_trellis, BoundMoE, "moe")(x, topk_weights, topk_ids, expert_map)


@exl3_moe.register_fake
def _(x, topk_weights, topk_ids, expert_map, w13_trellis):
    return torch.empty_like(x)
