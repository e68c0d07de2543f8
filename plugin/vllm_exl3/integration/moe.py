"""Routed experts (vLLM `RoutedExperts`) stored in EXL3.

ExLlamaV3 stores every expert's gate/up/down as its own linear (`experts.<e>.gate_proj.trellis`, …); vLLM maps
those names to `w13_<suffix>` (gate = shard w1, up = w3) and `w2_<suffix>` (down). We stack them into packed
buffers with our own weight loader (vLLM's default one silently skips names it does not know), keep only this
rank's experts (expert parallelism) and this rank's block range of the intermediate dim (tensor parallelism, see
geometry.py), and hand the whole expert loop to one custom op. vLLM does the routing before `apply` and the
TP/EP all-reduce of the partial sum after it.
"""

from __future__ import annotations

import logging

import torch

from . import binding, compat, compile_key, cpu_routing, telemetry
from ..format.index import LinearMeta
from ..format.constants import TILE
from ..format.errors import Exl3FormatError
from ..format.records import marker_value_problem
from ..format.tensors import check_delivered, unpack_signs
from ..format.geometry import Span, check_padding
from ..kernels import ops, parity
from ..kernels.interface import MoECall
from ..kernels.selection import choose_moe_backend, moe_layer_type
from ..kernels.specs import ACTIVATIONS, PROJECTIONS, W13, W2, ExpertStack, MoESpec

logger = logging.getLogger(__name__)

SHARD_PROJECTION = {"w1": "gate", "w3": "up", "w2": "down"}  # vLLM's expert shard ids
# vLLM's names of the experts' activations -> ours (kernels/specs.py ACTIVATIONS). gpt-oss's clamped SwiGLU is
# `swigluoai` for its interleaved fused gate_up and `swigluoai_uninterleave` for a packed one: the same math on
# our gate and up, which are never fused.
ACTIVATION_NAMES = {**{a: a for a in ACTIVATIONS}, "swigluoai_uninterleave": "swigluoai"}


class Exl3MoEMethod(compat.FusedMoEMethodBase):
    """One instance per RoutedExperts layer. `metas[(global expert, projection)]` come from the pack headers; a
    projection is one of kernels/specs.py PROJECTIONS ("gate", "up", "down")."""

    def __init__(self, moe: compat.FusedMoEConfig, prefix: str, names: dict[tuple[int, str], str],
                 metas: dict[tuple[int, str], LinearMeta]):
        super().__init__(moe)
        self.prefix, self.names, self.metas = prefix, names, metas
        self.last_block = False  # set by Exl3Config: this layer is in the model's last block (the parity gate)

    # -- weights ----------------------------------------------------------------------------------------------
    def create_weights(self, layer, num_experts, hidden_size, intermediate_size_per_partition, params_dtype,
                       **extra_weight_attrs):
        self.layer = layer
        # A routing correction bias the model allocated (torch.empty) and the pack may not hold (ExLlamaV3 writes
        # none for some families, format/families/): zero, which routes as ExLlamaV3 does without one; a pack
        # that holds it overwrites this when it loads.
        if getattr(layer, "e_score_correction_bias", None) is not None:
            layer.e_score_correction_bias.data.zero_()
        tp_rank, tp_size = compat.moe_parallel(layer)
        self.first_rank = tp_rank == 0
        self.own_routing = cpu_routing.needed(layer)
        inter_total = intermediate_size_per_partition * tp_size
        hidden = extra_weight_attrs.get("unpadded_hidden_size") or hidden_size
        self.local_to_global: list[int] = [-1] * num_experts
        for g in range(layer.global_num_experts):
            local = compat.local_expert_id(layer, g)
            if local != -1:
                self.local_to_global[local] = g
        if -1 in self.local_to_global:
            raise ValueError(f"{self.prefix}: the expert map leaves local experts without a global expert: "
                             f"{self.local_to_global}")
        local_metas = [(g, p, self.metas[(g, p)]) for g in self.local_to_global for p in PROJECTIONS]
        for g, p, m in local_metas:
            name = self.names[(g, p)]
            in_total, out_total = (hidden, inter_total) if p in W13 else (inter_total, hidden)
            check_padding(f"'{name}' in_features", in_total, m.in_padded)
            check_padding(f"'{name}' out_features", out_total, m.out_padded)
        i0 = tp_rank * intermediate_size_per_partition
        first = self.metas[(self.local_to_global[0], W13[0])]
        self.hidden_span = Span.around(0, hidden, first.in_padded)
        self.inter_span = Span.around(i0, i0 + intermediate_size_per_partition, first.out_padded)
        if self.inter_span.splits_a_block(inter_total):
            logger.info("EXL3 %s: tensor-parallel intermediate slice [%d, %d) of %d is not 128-aligned; this "
                        "rank keeps the enclosing blocks [%d, %d) of every expert (exact)", self.prefix,
                        self.inter_span.start, self.inter_span.stop, inter_total, self.inter_span.block_start,
                        self.inter_span.block_stop)
        # int16 words per tile record of each local expert's projections; the stack pads to the widest
        self.words = [{p: round(self.metas[(g, p)].bits * TILE) for p in PROJECTIONS} for g in self.local_to_global]
        w13, w2 = max(w[p] for w in self.words for p in W13), max(w[W2] for w in self.words)
        h, i = self.hidden_span.block_size, self.inter_span.block_size
        e = num_experts
        self._param(layer, "w13_trellis", torch.zeros(e, 2, h // TILE, i // TILE, w13, dtype=torch.int16))
        self._param(layer, "w13_suh", torch.empty(e, 2, h, dtype=torch.float16))
        self._param(layer, "w13_svh", torch.empty(e, 2, i, dtype=torch.float16))
        self._param(layer, "w2_trellis", torch.zeros(e, i // TILE, h // TILE, w2, dtype=torch.int16))
        self._param(layer, "w2_suh", torch.empty(e, i, dtype=torch.float16))
        self._param(layer, "w2_svh", torch.empty(e, h, dtype=torch.float16))
        # Expert biases (gpt-oss): fp32, zero where the pack holds none (as ExLlamaV3 computes such a pack)
        self.has_bias = bool(getattr(self.moe, "has_bias", False)) or any(m.has_bias for _, _, m in local_metas)
        if self.has_bias:
            self._param(layer, "w13_bias", torch.zeros(e, 2, i, dtype=torch.float32))
            self._param(layer, "w2_bias", torch.zeros(e, h, dtype=torch.float32))
        metas = [m for _, _, m in local_metas]
        extras = {m.codebook for m in metas if m.has_marker} | ({"su", "sv"} if any(m.legacy_signs for m in metas)
                                                              else set())
        for suffix in sorted(extras):  # markers are checked, legacy signs unpack into suh/svh: no storage
            for stem in ("w13", "w2"):
                self._param(layer, f"{stem}_{suffix}", torch.empty(0, dtype=torch.int32))
        self.loaded: set[tuple[int, str, str]] = set()

    def _param(self, layer, name: str, data: torch.Tensor) -> None:
        p = torch.nn.Parameter(data, requires_grad=False)
        p.exl3_suffix = name.split("_", 1)[1]
        p.weight_loader = self._load
        layer.register_parameter(name, p)

    def _load(self, param, loaded_weight, weight_name, shard_id, expert_id, return_success=False):
        local = compat.local_expert_id(self.layer, expert_id)
        if local == -1:
            return False  # another expert-parallel rank holds this expert
        proj, suffix = SHARD_PROJECTION[shard_id], param.exl3_suffix
        meta, name = self.metas[(expert_id, proj)], f"{self.names[(expert_id, proj)]}.{suffix}"
        rows, cols = (self.hidden_span, self.inter_span) if proj in W13 else (self.inter_span, self.hidden_span)
        if suffix == meta.codebook:  # a marker may arrive as [1]
            loaded_weight = loaded_weight.reshape(())
        if suffix == "bias":
            if not (meta.has_bias and loaded_weight.dim() == 1 and loaded_weight.is_floating_point()
                    and loaded_weight.shape[0] <= meta.out_padded):
                raise Exl3FormatError(None, name, f"a float bias of at most {meta.out_padded} features, as the "
                                      "pack header said", f"{loaded_weight.dtype}{list(loaded_weight.shape)}")
        else:
            check_delivered(meta, self.names[(expert_id, proj)], suffix, loaded_weight)
        key = (local, proj, suffix)
        if key in self.loaded:
            raise Exl3FormatError(None, name, "each tensor once", "a second copy")
        self.loaded.add(key)
        stem = "w13" if proj in W13 else "w2"
        dst = (lambda t: t[local, W13.index(proj)]) if proj in W13 else (lambda t: t[local])
        if suffix == "trellis":
            piece = loaded_weight[rows.tiles, cols.tiles]
            dst(getattr(self.layer, f"{stem}_trellis").data)[..., : piece.shape[-1]].copy_(piece)
        elif suffix == "bias":  # over the output features; a stored bias may stop short of the padding
            piece = loaded_weight[cols.block_start:cols.block_stop].float()
            dst(getattr(self.layer, f"{stem}_bias").data)[: piece.shape[0]].copy_(piece)
        elif suffix in ("suh", "svh", "su", "sv"):
            side = "suh" if suffix in ("suh", "su") else "svh"
            values = unpack_signs(loaded_weight.cpu()) if suffix in ("su", "sv") else loaded_weight
            span = rows if side == "suh" else cols
            dst(getattr(self.layer, f"{stem}_{side}").data).copy_(values[span.elements])
        elif problem := marker_value_problem(suffix, int(loaded_weight.item()), None, name):
            raise problem
        return True

    def get_fused_moe_quant_config(self, layer):
        return None  # we run our own kernels, not vLLM's modular ones

    # -- after loading --------------------------------------------------------------------------------------
    def process_weights_after_loading(self, layer) -> None:
        missing = []
        for local, g in enumerate(self.local_to_global):
            for p in PROJECTIONS:
                missing += [f"{self.names[(g, p)]}.{s}" for s in sorted(self.metas[(g, p)].suffixes)
                            if (local, p, s) not in self.loaded]
        if missing:
            raise Exl3FormatError(None, ", ".join(missing[:6]) + (" …" if len(missing) > 6 else ""),
                                  f"every expert tensor of {self.prefix} to be loaded",
                                  f"{len(missing)} never delivered by the checkpoint (a shard file missing from "
                                  "model.safetensors.index.json?)")
        codebooks = tuple(self.metas[(g, p)].codebook for g in self.local_to_global for p in PROJECTIONS)
        w13_bias = w2_bias = None
        if self.has_bias:
            w13_bias, w2_bias = layer.w13_bias.data, layer.w2_bias.data
            if not self.first_rank:  # tensor parallel: every rank's partial sum is all-reduced; add it once
                w2_bias.zero_()
        self.stack = ExpertStack(layer.w13_trellis.data, layer.w13_suh.data, layer.w13_svh.data,
                                 layer.w2_trellis.data, layer.w2_suh.data, layer.w2_svh.data,
                                 tuple(ws[p] for ws in self.words for p in W13), tuple(ws[W2] for ws in self.words),
                                 codebooks, self.inter_span.offset, self.inter_span.size, w13_bias, w2_bias)
        vllm_name = layer.activation.value if hasattr(layer.activation, "value") else str(layer.activation)
        activation = ACTIVATION_NAMES.get(vllm_name)
        if activation is None:
            raise ValueError(f"{self.prefix}: EXL3 experts support the gated activations "
                             f"{', '.join(ACTIVATION_NAMES)}, this model uses {vllm_name!r}")
        bits = tuple(self.metas[(g, p)].bits for g in self.local_to_global for p in PROJECTIONS)
        self._bind(layer, MoESpec(codebooks, bits, self.hidden_span.block_size, self.inter_span.block_size,
                                  len(self.local_to_global), activation, layer.params_dtype,
                                  layer.w13_trellis.device.type, self.has_bias))
        compile_key.record()  # vLLM's compile cache key (integration/compile_key.py)
        telemetry.layer_bound()  # the metrics exporter's view of this worker, once per load (telemetry.py)

    def _bind(self, layer, spec: MoESpec) -> None:
        """Choose the backend and bind the layer to it, serve that binding (kernels/ops.py), then let the parity gate
        compare it with the torch reference (which may bind the layer again, to the next backend)."""
        backend = choose_moe_backend(spec)
        call = MoECall(spec.activation, bool(layer.apply_router_weight_on_input),
                       getattr(self.moe, "experts_per_token", None), getattr(self.moe, "max_num_tokens", None),
                       getattr(layer, "swiglu_limit", None), getattr(layer, "swiglu_alpha", None))
        self.bound = bound = backend.bind_moe(self.stack, call)  # the layer keeps it alive; the ops hold it weakly
        ops.serve(bound)
        binding.bind_checked(self.prefix, moe_layer_type(spec), backend, spec.act_dtype,
                             lambda: parity.moe_error(bound, self.hidden_span.size, spec.act_dtype),
                             lambda: self._bind(layer, spec), self.last_block)

    # -- forward --------------------------------------------------------------------------------------------
    @property
    def is_monolithic(self) -> bool:
        """True where vLLM's own router would route this layer wrongly (integration/cpu_routing.py): vLLM then calls
        `apply_monolithic` with the router logits."""
        return getattr(self, "own_routing", False)

    def apply(self, layer, x, topk_weights, topk_ids, shared_experts, shared_experts_input):
        del shared_experts, shared_experts_input  # the runner computes shared experts itself
        return torch.ops.vllm_exl3.moe(x, topk_weights, topk_ids, layer.expert_map, layer.w13_trellis)

    def apply_monolithic(self, layer, x, router_logits, input_ids=None):
        topk_weights, topk_ids = cpu_routing.select(layer, router_logits)
        return torch.ops.vllm_exl3.moe(x, topk_weights, topk_ids, layer.expert_map, layer.w13_trellis)
