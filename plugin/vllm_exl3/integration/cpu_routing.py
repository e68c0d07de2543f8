"""Routing the MoE layers vLLM's CPU build routes wrongly, done by the plugin's MoE method instead: vLLM hands a
quantization method that says it is "monolithic" the router logits rather than its own routing.

vLLM 0.32's CPU router (fused_moe/router/cpu_router.py) routes a layer that is not grouped top-k by softmax alone:
it ignores a correction bias (ERNIE-4.5 picks experts by softmax + bias, weighs them by the softmax) and stops at an
assertion on sigmoid scoring (MiniMax-M2: sigmoid scores, a correction bias that only picks, weights renormalised).
On GPUs vLLM's routers compute both, and the plugin leaves routing to them.
"""

from __future__ import annotations

import torch

from . import compat


def needed(layer) -> bool:
    """Whether vLLM's CPU router would route this RoutedExperts layer wrongly (or not at all)."""
    return (compat.on_cpu() and not getattr(layer, "use_grouped_topk", False)
            and getattr(layer, "custom_routing_function", None) is None
            and (getattr(layer, "scoring_func", "softmax") != "softmax"
                 or getattr(layer, "e_score_correction_bias", None) is not None))


def select(layer, router_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(topk_weights fp32 [M, k], topk_ids int32 [M, k]): scores by the layer's scoring function, experts picked by
    score + correction bias, weighed by their scores (renormalised when the layer says so, then scaled)."""
    logits = router_logits.float()
    if layer.scoring_func == "softmax":
        scores = logits.softmax(dim=-1)
    elif layer.scoring_func == "sigmoid":
        scores = logits.sigmoid()
    else:
        raise ValueError(f"EXL3 routing on the CPU: scoring function {layer.scoring_func!r} (softmax or sigmoid)")
    bias = layer.e_score_correction_bias
    pick = scores if bias is None else scores + bias.float().reshape(1, -1)
    ids = pick.topk(layer.top_k, dim=-1).indices
    weights = scores.gather(1, ids)
    if layer.renormalize:
        weights = weights / weights.sum(dim=-1, keepdim=True)
    if layer.routed_scaling_factor != 1.0:
        weights = weights * layer.routed_scaling_factor
    return weights, ids.to(torch.int32)
