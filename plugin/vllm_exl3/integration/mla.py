"""Multi-head latent attention (DeepSeek-V2/V3, GLM-4.7-Flash): a `kv_b_proj` stored as an EXL3 linear.

vLLM's MLA attention never runs `kv_b_proj` as a GEMM when decoding. After every linear's quant method has
processed its weights, `MLAAttention.process_weights_after_loading` (vllm/model_executor/layers/attention/
mla_attention.py, `split_kv_b_proj`) builds the absorbed W_UK / W_UV from
`get_and_maybe_dequant_weights(kv_b_proj)` (vllm/model_executor/layers/quantization/utils/quant_utils.py). That
looks up `layer.weight`, `.qweight` or `.weight_packed` (an EXL3 layer has none of them: AttributeError, the
engine does not start) and then, for a quant method it does not know, takes `quant_method.apply(layer, eye(in))`
transposed. Only the prefill path calls `kv_b_proj(kv_c_normed)` itself.

ExLlamaV3 keeps kv_b_proj unquantized (modules/mla_attn.py: the absorb is a batched GEMM, not an EXL3 one) and its
converter writes it as a plain F16 `.weight`, which vLLM serves as it serves any plain linear. A pack from another
writer may store it as an EXL3 linear: that layer is served the same way, its weight decoded once at load (this
rank's block range, the reference decoder), kept as the layer's `.weight` in the model dtype with the EXL3
tensors freed; the layer's forward is then a plain `F.linear`, so vLLM's identity product returns that weight
exactly. Without MLA (VLLM_MLA_DISABLE=1, the per-head K/V path) kv_b_proj is an ordinary GEMM and stays EXL3.
"""

from __future__ import annotations

import logging

import torch

from ..format.reference import full_weight
from ..format.tensors import Exl3Weights

logger = logging.getLogger(__name__)

KV_B_PROJ = "kv_b_proj"


def decoded_at_load(prefix: str, vllm_config) -> bool:
    """Is `prefix` the kv_b_proj of an MLA attention layer vLLM builds with its absorbed (latent) path?"""
    model_config = getattr(vllm_config, "model_config", None)
    return prefix.rpartition(".")[2] == KV_B_PROJ and bool(getattr(model_config, "use_mla", False))


def decode_shard(layer: torch.nn.Module, shard) -> torch.Tensor:
    """This rank's slice of one EXL3 shard as a dense [out, in] weight in the layer's dtype (fp32 decode)."""
    kt, nt, words = shard.trellis_shape
    t0 = shard.offsets["trellis"]
    w = Exl3Weights(layer.trellis.data[t0:t0 + kt * nt * words].view(kt, nt, words),
                    layer.suh.data[shard.offsets["suh"]:shard.offsets["suh"] + shard.rows.block_size],
                    layer.svh.data[shard.offsets["svh"]:shard.offsets["svh"] + shard.cols.block_size],
                    shard.meta.codebook, shard.meta.bits)
    rows, cols = shard.rows, shard.cols
    full = full_weight(w)  # (in, out) over the stored block ranges
    return full[rows.offset:rows.offset + rows.size, cols.offset:cols.offset + cols.size].t().to(layer.params_dtype)


def densify(layer: torch.nn.Module, prefix: str, shards: list) -> None:
    """Replace the layer's EXL3 storage by its decoded weight: `layer.weight` [out, in] (what vLLM's MLA reads),
    served by Exl3LinearMethod.apply as one plain shard. The shards' loads were checked by the caller."""
    parts = []
    for s in shards:
        if s.meta is None:  # a plain shard of a mixed layer, already in layer.weight
            parts.append(layer.weight.data[s.offsets["weight"]:s.offsets["weight"] + s.cols.size])
        else:
            parts.append(decode_shard(layer, s))
    weight = torch.cat(parts, 0).contiguous() if len(parts) > 1 else parts[0].contiguous()
    for name in ("trellis", "suh", "svh", "su", "sv", "weight"):
        if name in layer._parameters:
            del layer._parameters[name]
    layer.register_parameter("weight", torch.nn.Parameter(weight, requires_grad=False))
    layer.register_buffer("exl3_plain_0", layer.weight.data, persistent=False)
    layer.exl3_shards = [("plain", 0, None)]
    layer.exl3_group = 0
    layer.exl3_out_pad = 0
    layer.exl3_decoded = True
    logger.info("EXL3 %s: MLA kv_b_proj decoded at load to a %s %s weight (vLLM absorbs it into W_UK/W_UV)",
                prefix, list(weight.shape), str(weight.dtype).removeprefix("torch."))
