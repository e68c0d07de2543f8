"""Dense EXL3 linears in vLLM: column/row/merged/QKV/replicated layers and the LM head.

A vLLM layer can fuse several checkpoint linears (q/k/v, gate/up). Each keeps its own suh/svh and is bound (and
parity-gated) on its own. When every shard as this rank stores it is a whole EXL3 linear (its slice exactly its stored
128-blocks: always at tp 1, and for 128-aligned head slices) of one codebook and bit width, bound to a backend with a
grouped kernel, the layer runs them as one call of it (gated as its own layer type; `VLLM_EXL3_GROUP_LINEARS=0`
turns it off). Otherwise the same op (`vllm_exl3::linear_group`) calls each shard's own binding and puts the outputs
side by side (kernels/interface.py SideBySideLinearGroup says why inside one op). A shard may also be a plain (BF16)
weight in a mixed layer (`non_routed_exl3.bf16_shards`); such a layer's shards are called one by one and
concatenated.

Storage per layer: one flat parameter per checkpoint suffix (`trellis`, `suh`, `svh`, …) holding every shard's
block range back to back, so the names vLLM's loaders look up (`<module>.<suffix>`) always exist; each
parameter's own `weight_loader` slices the full checkpoint tensor for this rank (see geometry.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

import torch
import torch.nn.functional as F

from . import binding, compat, compile_key, telemetry
from ..format.index import LinearMeta
from ..format.constants import TILE
from ..format.errors import Exl3FormatError
from ..format.records import marker_value_problem
from ..format.tensors import Exl3Weights, check_delivered, unpack_signs
from ..format.geometry import Span, check_padding
from ..kernels import ops, parity
from ..kernels.interface import BoundLinear, BoundLinearGroup, SideBySideLinearGroup
from ..kernels.selection import (choose_linear_backend, choose_linear_group_backend, linear_group_layer_type,
                                 linear_layer_type)
from ..kernels.specs import LinearSpec

logger = logging.getLogger(__name__)


@dataclass
class Shard:
    """One checkpoint linear inside a vLLM layer, as this rank stores it."""

    name: str  # checkpoint module prefix (after vLLM's rename mapper)
    shard_id: str | int | None  # the id vLLM's loaders pass for it (q/k/v, 0/1, None)
    meta: LinearMeta | None  # None: a plain weight
    rows: Span  # input features (stored block range around this rank's slice)
    cols: Span  # output features
    plain_shape: tuple[int, ...] | None = None  # the `.weight` the pack stores under `name`, if any
    offsets: dict[str, int] = field(default_factory=dict)  # start of this shard in each flat parameter
    loaded: set[str] = field(default_factory=set)

    @property
    def words(self) -> int:
        return round(self.meta.bits * TILE) if self.meta else 0

    @property
    def trellis_shape(self) -> tuple[int, int, int]:
        return self.rows.block_size // TILE, self.cols.block_size // TILE, self.words

    def expected(self) -> set[str]:
        return {"weight"} if self.meta is None else self.meta.suffixes


def _output_ranges(layer: torch.nn.Module, shard_ids: list) -> list[tuple[list[tuple[int, int]], int]]:
    """Per shard: the [start, stop) ranges of its checkpoint linear's outputs this rank holds, in layer output order,
    and the checkpoint linear's out_features.

    A merged layer's shard id may be a tuple of consecutive `output_sizes` entries (vLLM's stacked weights mapper:
    Qwen3.5 loads `in_proj_qkv` into entries (0, 1, 2) of `in_proj_qkvz`, `in_proj_z` into 3). Every entry is split
    across ranks on its own, so under tensor parallelism one rank holds one range per entry of that one checkpoint
    linear (its q, k and v slices); at tp 1 they are adjacent and plan_shards joins them."""
    rank = layer.tp_rank
    if compat.is_lm_head(layer):
        si = layer.shard_indices
        return [([(si.org_vocab_start_index, si.org_vocab_end_index)], layer.org_vocab_size)]
    if compat.is_qkv(layer):
        heads = {"q": (layer.total_num_heads, layer.head_size), "k": (layer.total_num_kv_heads, layer.head_size),
                 "v": (layer.total_num_kv_heads, layer.v_head_size)}
        out = []
        for sid in shard_ids:  # "q", "k", "v", or (0, 1, 2): q, k and v fused on disk (a vision tower's `attn.qkv`)
            ranges, base = [], 0
            for e in ("q", "k", "v") if isinstance(sid, tuple) else (sid,):
                part = layer.output_partition_sizes["qkv".index(e)]
                owner = rank if e == "q" else rank // layer.num_kv_head_replicas  # K/V heads may be replicated
                ranges.append((base + owner * part, base + owner * part + part))
                base += heads[e][0] * heads[e][1]
            out.append((ranges, base))
        return out
    if compat.is_column_parallel(layer):
        totals = getattr(layer, "output_sizes", [layer.output_size])
        parts = layer.output_partition_sizes
        out = []
        for i, sid in enumerate(shard_ids):
            entries = sid if isinstance(sid, tuple) else (sid if isinstance(sid, int) else i,)
            ranges, base = [], 0
            for e in entries:
                ranges.append((base + rank * parts[e], base + rank * parts[e] + parts[e]))
                base += totals[e]
            out.append((ranges, base))
        return out
    return [([(0, layer.output_size)], layer.output_size)]


def _joined(ranges: list[tuple[int, int]]) -> list[tuple[int, int]]:
    """Adjacent ranges as one."""
    out: list[tuple[int, int]] = []
    for a, b in ranges:
        if out and out[-1][1] == a:
            out[-1] = (out[-1][0], b)
        else:
            out.append((a, b))
    return out


def plan_shards(layer: torch.nn.Module, names: list[str], shard_ids: list, metas: list[LinearMeta | None],
                plain_shapes: list[tuple[int, ...] | None]) -> list[Shard]:
    in_total = layer.input_size
    if compat.is_row_parallel(layer):
        i0 = layer.tp_rank * layer.input_size_per_partition
        in_range = (i0, i0 + layer.input_size_per_partition)
    else:
        in_range = (0, in_total)
    shards = []
    for name, sid, meta, shape, (ranges, out_total) in zip(names, shard_ids, metas, plain_shapes,
                                                           _output_ranges(layer, shard_ids)):
        if meta is not None:
            check_padding(f"'{name}' in_features", in_total, meta.in_padded)
            check_padding(f"'{name}' out_features", out_total, meta.out_padded)
            if shape is not None and tuple(shape) != (out_total, in_total):
                raise Exl3FormatError(None, f"{name}.weight", f"a stale plain copy of shape [{out_total}, {in_total}] "
                                      "next to the EXL3 tensors (it is dropped)", str(list(shape)))
        elif shape is None or tuple(shape) != (out_total, in_total):
            raise Exl3FormatError(None, f"{name}.weight", f"a plain weight of shape [{out_total}, {in_total}] "
                                  "(no EXL3 tensors were found for this linear)",
                                  "nothing" if shape is None else str(list(shape)))
        for o0, o1 in _joined(ranges):
            if meta is None:
                shards.append(Shard(name, sid, None, Span(*in_range, *in_range), Span(o0, o1, o0, o1), shape))
                continue
            rows, cols = Span.around(*in_range, meta.in_padded), Span.around(o0, o1, meta.out_padded)
            for what, span, total in (("input", rows, in_total), ("output", cols, out_total)):
                if span.splits_a_block(total):
                    logger.info("EXL3 %s: tensor-parallel %s slice [%d, %d) of %d is not 128-aligned; this rank "
                                "keeps the enclosing blocks [%d, %d) (exact, %d extra features)", name, what,
                                span.start, span.stop, total, span.block_start, span.block_stop,
                                span.block_size - span.size)
            shards.append(Shard(name, sid, meta, rows, cols, shape))
    return shards


class Exl3LinearMethod(compat.LinearMethodBase):
    """LinearMethodBase for layers with at least one EXL3 shard (one instance per layer)."""

    def __init__(self, prefix: str, names: list[str], shard_ids: list, metas: list[LinearMeta | None],
                 plain_shapes: list[tuple[int, ...] | None]):
        self.prefix = prefix
        self.names, self.shard_ids, self.metas, self.plain_shapes = names, shard_ids, metas, plain_shapes
        self.shards: list[Shard] = []
        self.bound: dict[int, BoundLinear] = {}  # shard index -> its binding (kernels/ops.py serves it)
        self.group: BoundLinearGroup | None = None  # every shard in one call, when _regroup finds that possible
        self.last_block = False  # set by Exl3Config: this layer is in the model's last block (the parity gate)
        self.decode_at_load = False  # set by Exl3Config: an MLA kv_b_proj, served decoded (integration/mla.py)

    # -- weights ----------------------------------------------------------------------------------------------
    def create_weights(self, layer, input_size_per_partition, output_partition_sizes, input_size, output_size,
                       params_dtype, **extra_weight_attrs):
        self.layer = layer
        self.shards = plan_shards(layer, self.names, self.shard_ids, self.metas, self.plain_shapes)
        totals = {"trellis": 0, "suh": 0, "svh": 0, "weight": 0}
        for s in self.shards:
            if s.meta is None:
                s.offsets["weight"] = totals["weight"]
                totals["weight"] += s.cols.size
                continue
            for key, n in (("trellis", s.rows.block_size * s.cols.block_size * s.words // (TILE * TILE)),
                           ("suh", s.rows.block_size), ("svh", s.cols.block_size)):
                s.offsets[key] = totals[key]
                totals[key] += n
        self._param(layer, "trellis", torch.empty(totals["trellis"], dtype=torch.int16), self._load_trellis)
        self._param(layer, "suh", torch.empty(totals["suh"], dtype=torch.float16), self._load_scale)
        self._param(layer, "svh", torch.empty(totals["svh"], dtype=torch.float16), self._load_scale)
        metas = [s.meta for s in self.shards if s.meta]
        if any(m.legacy_signs for m in metas):  # legacy sign bitfields unpack straight into suh/svh
            self._param(layer, "su", torch.empty(0, dtype=torch.int16), self._load_scale)
            self._param(layer, "sv", torch.empty(0, dtype=torch.int16), self._load_scale)
        for cb in sorted({m.codebook for m in metas if m.has_marker}):
            self._param(layer, cb, torch.empty(0, dtype=torch.int32), self._load_marker)
        if any(shape is not None for shape in self.plain_shapes):  # plain shards, or stale copies to drop
            k = self.shards[0].rows.size
            self._param(layer, "weight", torch.empty(totals["weight"], k, dtype=params_dtype), self._load_plain)
        layer.exl3_method_shards = self.shards

    @staticmethod
    def _param(layer, name: str, data: torch.Tensor, loader) -> None:
        p = torch.nn.Parameter(data, requires_grad=False)
        p.exl3_suffix = name
        p.weight_loader = loader  # our own loader: vLLM's default silently skips unknown names
        layer.register_parameter(name, p)

    def _targets(self, shard_id, suffix: str) -> list[Shard]:
        """The shards a checkpoint tensor delivered with `shard_id` goes to: those of that id (one checkpoint linear, in
        one or more output ranges); without an id, every shard, which must then be of one checkpoint linear."""
        matches = [s for s in self.shards if s.shard_id == shard_id] if shard_id is not None else self.shards
        if not matches or len({s.name for s in matches}) != 1:
            raise ValueError(f"{self.prefix}: cannot place checkpoint tensor '.{suffix}' for shard {shard_id!r} "
                             f"(shards: {[s.shard_id for s in self.shards]})")
        return matches

    def _check(self, s: Shard, suffix: str, tensor: torch.Tensor) -> None:
        """Each tensor once, as its header said (format/tensors.py; a plain weight: the shape the index recorded)."""
        if s.meta is not None and suffix != "weight":
            check_delivered(s.meta, s.name, suffix, tensor)
        elif tuple(tensor.shape) != (shape := tuple(s.plain_shape)):
            raise Exl3FormatError(None, f"{s.name}.{suffix}", f"{list(shape)} as the pack header said",
                                  f"{tensor.dtype}{list(tensor.shape)}")
        if suffix in s.loaded:
            raise Exl3FormatError(None, f"{s.name}.{suffix}", "each tensor once", "a second copy")
        s.loaded.add(suffix)

    def _load_trellis(self, param, loaded_weight, shard_id=None):
        for s in self._targets(shard_id, "trellis"):
            self._check(s, "trellis", loaded_weight)
            piece = loaded_weight[s.rows.tiles, s.cols.tiles]
            n = piece.numel()
            param.data[s.offsets["trellis"]:s.offsets["trellis"] + n].view(piece.shape).copy_(piece)

    def _load_scale(self, param, loaded_weight, shard_id=None):
        suffix = param.exl3_suffix
        side = "suh" if suffix in ("suh", "su") else "svh"
        dst = getattr(self.layer, side)  # legacy `.su`/`.sv` land in the suh/svh storage
        for s in self._targets(shard_id, suffix):
            span = s.rows if side == "suh" else s.cols
            self._check(s, suffix, loaded_weight)
            values = unpack_signs(loaded_weight.cpu()) if suffix in ("su", "sv") else loaded_weight
            dst.data[s.offsets[side]:s.offsets[side] + span.block_size].copy_(values[span.elements])

    def _load_marker(self, param, loaded_weight, shard_id=None):
        codebook = param.exl3_suffix
        for s in self._targets(shard_id, codebook):
            self._check(s, codebook, loaded_weight.reshape(()))
            value = int(loaded_weight.reshape(()).item())
            if problem := marker_value_problem(codebook, value, None, f"{s.name}.{codebook}"):
                raise problem

    def _load_plain(self, param, loaded_weight, shard_id=None):
        for s in self._targets(shard_id, "weight"):
            self._check(s, "weight", loaded_weight)
            if s.meta is not None:  # a stale BF16 copy next to EXL3 tensors (shape checked in plan_shards): dropped
                continue
            rows = loaded_weight[s.cols.start:s.cols.stop, s.rows.start:s.rows.stop]
            param.data[s.offsets["weight"]:s.offsets["weight"] + s.cols.size].copy_(rows)

    # -- after loading --------------------------------------------------------------------------------------
    def process_weights_after_loading(self, layer) -> None:
        for s in self.shards:
            missing = s.expected() - s.loaded
            if missing:
                raise Exl3FormatError(None, ", ".join(f"{s.name}.{m}" for m in sorted(missing)),
                                      "every tensor of this linear to be loaded",
                                      "never delivered by the checkpoint (a shard file missing from "
                                      "model.safetensors.index.json?)")
        if self.decode_at_load:
            from . import mla

            mla.densify(layer, self.prefix, self.shards)
            return
        layer.exl3_shards = []
        layer.exl3_group = 0  # the grouped call's output width, 0 while the shards are called one by one
        self.bound.clear()
        for i, s in enumerate(self.shards):
            if s.meta is None:
                w = layer.weight.data[s.offsets["weight"]:s.offsets["weight"] + s.cols.size]
                layer.register_buffer(f"exl3_plain_{i}", w, persistent=False)
                layer.exl3_shards.append(("plain", i, None))
                continue
            kt, nt, words = s.trellis_shape
            t0, n = s.offsets["trellis"], kt * nt * words
            w = Exl3Weights(layer.trellis.data[t0:t0 + n].view(kt, nt, words),
                            layer.suh.data[s.offsets["suh"]:s.offsets["suh"] + s.rows.block_size],
                            layer.svh.data[s.offsets["svh"]:s.offsets["svh"] + s.cols.block_size],
                            s.meta.codebook, s.meta.bits)
            layer.register_buffer(f"exl3_trellis_{i}", w.trellis, persistent=False)  # what the op is called with
            layer.exl3_shards.append(("exl3", i, s.cols.size))
            self._bind(layer, i, s, w)  # the last shard's binding also groups them (_regroup)
        layer.exl3_out_pad = (layer.num_embeddings_per_partition - sum(s.cols.size for s in self.shards)
                              if compat.is_lm_head(layer) else 0)
        compile_key.record()  # vLLM's compile cache key (integration/compile_key.py)
        telemetry.layer_bound()  # the metrics exporter's view of this worker, once per load (telemetry.py)

    def _bind(self, layer, i: int, s: Shard, w: Exl3Weights) -> None:
        """Choose shard i's backend and bind it, serve that binding (kernels/ops.py), then let the parity gate
        compare it with the torch reference (which may bind it again, to the next backend)."""
        spec = LinearSpec(s.meta.codebook, s.meta.bits, s.rows.block_size, s.cols.block_size, layer.params_dtype,
                          w.trellis.device.type)
        backend = choose_linear_backend(spec)
        bound = backend.bind_linear(w, s.rows.offset, s.cols.offset, s.cols.size)
        ops.serve(bound)
        self.bound[i] = bound  # the layer keeps its binding alive; the ops hold it weakly
        binding.bind_checked(s.name, linear_layer_type(spec), backend, layer.params_dtype,
                             lambda: parity.linear_error(bound, s.rows.size, layer.params_dtype),
                             lambda: self._bind(layer, i, s, w), self.last_block)
        self._regroup(layer)  # after every (re)binding of a shard: the group follows the shards' backend

    def _regroup(self, layer) -> None:
        """Bind every shard of the layer as one call once all are bound: the backend's grouped kernel when they allow
        it (see the module's docstring), else their own calls side by side in one op (SideBySideLinearGroup says why
        not a cat in the graph). A shard bound again (a fallback) regroups."""
        self.group, layer.exl3_group = None, 0
        shards = [(i, s) for i, s in enumerate(self.shards) if s.meta is not None]
        if len(shards) < 2 or len(shards) != len(self.shards) or len(self.bound) < len(shards):
            return
        if (grouped := self._grouped_kernel(layer, shards)) is not None:
            backend, spec, group = grouped
            self._serve_group(layer, group)
            binding.bind_checked(f"{self.prefix} (grouped)", linear_group_layer_type(spec), backend,
                                 layer.params_dtype, lambda: parity.linear_group_error(group, layer.params_dtype),
                                 lambda: self._regroup(layer), self.last_block)
            return
        self._serve_group(layer, SideBySideLinearGroup([self.bound[i] for i, _ in shards]))

    def _grouped_kernel(self, layer, shards: list[tuple[int, Shard]]):
        """(backend, spec, group) when the shards' backend has a grouped kernel for them, else None."""
        # Each shard as stored is then a whole linear: this rank's slice is exactly its stored blocks (no offset,
        # no padding), as for every shard at tp 1 and for 128-aligned head slices under tensor parallelism.
        whole = all(s.rows.offset == 0 and s.rows.size == s.rows.block_size and
                    s.cols.offset == 0 and s.cols.size == s.cols.block_size for _, s in shards)
        first = shards[0][1]
        alike = all((s.meta.codebook, s.meta.bits, s.rows.block_size) ==
                    (first.meta.codebook, first.meta.bits, first.rows.block_size) for _, s in shards)
        backends = {self.bound[i].backend for i, _ in shards}
        if not (whole and alike and len(backends) == 1):
            return None
        spec = LinearSpec(first.meta.codebook, first.meta.bits, first.rows.block_size,
                          sum(s.cols.block_size for _, s in shards), layer.params_dtype,
                          self.bound[shards[0][0]].w.trellis.device.type)
        backend = choose_linear_group_backend(spec, len(shards), backends.pop())
        if backend is None:
            return None
        return backend, spec, backend.bind_linear_group([self.bound[i] for i, _ in shards])

    def _serve_group(self, layer, group: BoundLinearGroup) -> None:
        ops.serve(group)
        self.group, layer.exl3_group = group, group.out_features

    def tie_weights(self, layer, embed_tokens):
        # ExLlamaV3 always writes its own lm_head (docs/format.md §4.1): keep it even if the config says tied.
        logger.info("EXL3 %s: keeping the pack's own lm_head instead of tying it to the embeddings", self.prefix)
        return layer

    # -- forward --------------------------------------------------------------------------------------------
    def apply(self, layer, x: torch.Tensor, bias: torch.Tensor | None = None) -> torch.Tensor:
        x2 = x.reshape(-1, x.shape[-1])
        if layer.exl3_group:  # every shard in one op (_regroup): their outputs side by side are the layer's
            y = torch.ops.vllm_exl3.linear_group(x2, layer.exl3_trellis_0, layer.exl3_group)
            if bias is not None:
                y = y + bias
            return y.reshape(*x.shape[:-1], y.shape[-1])
        outs = []
        for kind, i, out_features in layer.exl3_shards:
            if kind == "plain":
                outs.append(F.linear(x2, getattr(layer, f"exl3_plain_{i}")))
            else:
                outs.append(torch.ops.vllm_exl3.linear(x2, getattr(layer, f"exl3_trellis_{i}"), out_features))
        y = outs[0] if len(outs) == 1 else torch.cat(outs, dim=-1)
        if layer.exl3_out_pad:  # vocab padding columns of this rank (sliced off by the logits processor)
            y = F.pad(y, (0, layer.exl3_out_pad))
        if bias is not None:
            y = y + bias
        return y.reshape(*x.shape[:-1], y.shape[-1])
