"""Routed experts on ExLlamaV3's own kernels: one `exllamav3.modules.BlockSparseMLP` per layer, built over our
`ExpertStack`'s tensors (no 16-bit copy), with vLLM's routing handed in.

What is built once per layer (`build`): a `Linear` wrapping a `LinearEXL3` per (expert, projection) whose trellis,
suh and svh are views of the stack, then `BlockSparseMLP.load_local()`, which makes ExLlamaV3's pointer tables,
its bound decode class and its shared buffers, the same way ExLlamaV3 assembles a tensor-parallel slice of a layer
(`BlockSparseMLP.tp_import`). The router stays vLLM's: the module's `routing_fn` returns the ids and weights of the
call. Everything else (the fused decode kernels up to `MAX_DECODE_TOKENS` tokens, the fused / batched-reconstruct /
per-expert tiers above) is ExLlamaV3's own `forward`, so this backend runs exactly what ExLlamaV3 runs.

Our interface mapped onto ExLlamaV3's:
- Expert parallelism: the module is built with one phantom expert more than it holds, so ExLlamaV3 treats it as an
  expert-range slice [0, E) and drops every pick outside it (in-kernel on the decode path, as a sentinel bucket
  above); vLLM's `expert_map` turns global ids into local ones and other ranks' experts into -1.
- A tensor-parallel slice that starts or ends inside a 128-block: the stack holds the whole block range; the gate
  and up projections' svh (their per-output-column scales) are copied with zeros outside the slice, so the gated
  activation is zero there (the clamped SwiGLU's `up + 1` included: its gate is zero too) and the down projection
  sees a zero-filled input, as the interface asks. Only those [E, 2, I] fp16 vectors are copied, and only for such
  slices.
- ExLlamaV3's kernels read fp16 activations and fp16 routing weights and return fp32: bf16 is cast in and out.
- Its `gelu` is the tanh form (exllamav3_ext/activation_kernels.cuh), so it serves our `gelu_tanh`, not `gelu`.
- gpt-oss's clamped SwiGLU is its `swiglu_oai` with `act_limit` (its alpha is fixed in the kernel, EXLLAMAV3_ALPHA);
  expert biases ride on each expert's LinearEXL3 (fp16, as ExLlamaV3 loads them), which routes such a layer through
  its fused decode kernels up to MAX_DECODE_TOKENS tokens and its per-expert path above (its quantized batch tiers
  take no biases).

CUDA graphs: ExLlamaV3's forward above `MAX_DECODE_TOKENS` tokens reads expert counts back to the host (bincount,
`tolist`), which a graph cannot hold. While a stream is capturing, such a call takes one of two capturable
routes instead, built from the same kernels: the fused expert kernel over device-made routing tables
(`ext.exl3_moe` + `ext.exl3_moe_gather`, the tier ExLlamaV3 itself takes when the counts need no read-back) in
chunks small enough that no expert can exceed its row capacity, for layers whose codebook the fused kernel takes
(mcg, mul1); else the decode kernels over chunks of `MAX_DECODE_TOKENS` tokens. Eager calls always take
ExLlamaV3's own route. The capturable routes cost more than ExLlamaV3's eager one at large batches (docs/moe.md
has the numbers); `--max-cudagraph-capture-size` bounds the batches vLLM captures.
"""

from __future__ import annotations

import functools
import inspect

import torch

from ...format.constants import CODEBOOK_3INST, MARKER_VALUE
from ...format.reference import zero_extend
from ..interface import MoECall
from ..specs import PROJECTIONS, W13, ExpertStack, MoESpec

# ExLlamaV3's names for our activations (kernels.specs.ACTIVATIONS); an activation absent here is refused.
ACTIVATION = {"silu": "silu", "gelu_tanh": "gelu", "swigluoai": "swiglu_oai"}
EXLLAMAV3_ALPHA = 1.702  # swiglu_oai's sigmoid scale, a constant of exllamav3_ext/activation_kernels.cuh
MAX_DECODE_TOKENS = 8  # exllamav3/modules/block_sparse_mlp.py MAX_BSZN: the fused decode kernels' batch
MAX_TOP_K = 32  # ... TEMP_ROWS_GRAPH: BlockSparseMLP refuses more experts per token
# What this adaptor calls, checked against the installed package before any layer is built.
EXT_ENTRY_POINTS = ("BC_BlockSparseMLP", "BC_LinearEXL3", "exl3_moe", "exl3_moe_gather", "exl3_moe_max_concurrency")
MODULE_KWARGS = ("num_local_experts", "activation_fn", "act_limit", "gates", "ups", "downs", "routing_first",
                 "routing_last")
MODULE_METHODS = ("load_local", "forward")
MODULE_ATTRS = ("routing_fn", "routing_gate", "bc", "fused_mode_buffers", "fused_rows", "support_fused", "multi_gate",
                "multi_up", "multi_down", "activation_fn_idx", "act_limit", "experts_cfg")  # set by load_local
KEY = "vllm_exl3.moe"  # ExLlamaV3 module keys (only used in its messages)


@functools.lru_cache(maxsize=None)
def api_reason() -> str | None:
    """Why the installed exllamav3 cannot run this adaptor (None: it can). ExLlamaV3 changed its MoE kernel
    arguments in 1.5.0; this adaptor was written against 1.6.x's BlockSparseMLP and names what it misses."""
    try:
        from exllamav3.ext import exllamav3_ext as ext
        from exllamav3.modules import block_sparse_mlp as bsm
        from exllamav3.version import __version__ as version
    except ImportError as e:
        return f"exllamav3's MoE module does not import ({e})"
    missing = [f"exllamav3_ext.{n}" for n in EXT_ENTRY_POINTS if not hasattr(ext, n)]
    params = inspect.signature(bsm.BlockSparseMLP.__init__).parameters
    missing += [f"BlockSparseMLP({k}=...)" for k in MODULE_KWARGS if k not in params]
    missing += [f"BlockSparseMLP.{m}" for m in MODULE_METHODS if not hasattr(bsm.BlockSparseMLP, m)]
    if getattr(bsm, "MAX_BSZN", None) != MAX_DECODE_TOKENS:
        missing.append(f"MAX_BSZN == {MAX_DECODE_TOKENS} (found {getattr(bsm, 'MAX_BSZN', None)})")
    if missing:
        return (f"exllamav3 {version} does not provide what its routed-expert path needs here: {', '.join(missing)} "
                "(expected ExLlamaV3 1.6.x's BlockSparseMLP)")
    return None


def unsupported_reason(spec: MoESpec) -> str | None:
    if spec.activation not in ACTIVATION:
        return (f"activation {spec.activation!r}: this adaptor passes ExLlamaV3's expert kernels "
                f"{', '.join(ACTIVATION)} (its gelu is the tanh form)")
    if len(set(spec.codebooks)) > 1:
        return f"codebooks {sorted(set(spec.codebooks))} in one layer (ExLlamaV3's expert kernels take one per layer)"
    for p, proj in enumerate(PROJECTIONS):
        bits = set(spec.bits[p::len(PROJECTIONS)])
        if len(bits) > 1:
            return (f"{proj} projections of {len(bits)} bit widths {sorted(bits)} (ExLlamaV3's expert tables take "
                    "one width per projection)")
    return None


def _marker(codebook: str, device) -> torch.Tensor:
    value = MARKER_VALUE[codebook]
    return torch.tensor(value - (1 << 32) if value >= 1 << 31 else value, dtype=torch.int32, device=device)


def linear_exl3(trellis: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, codebook: str, out_dtype=None,
                bias: torch.Tensor | None = None):
    """ExLlamaV3's LinearEXL3 over our tensors (views: a contiguous trellis is not copied; an fp32 bias becomes
    fp16, as ExLlamaV3 keeps it); building the first one loads (or JIT-compiles) exllamav3_ext."""
    from exllamav3.modules.quant.exl3 import LinearEXL3

    markers = {"mcg": None, "mul1": None}
    if codebook != CODEBOOK_3INST:
        markers[codebook] = _marker(codebook, trellis.device)
    return LinearEXL3(None, suh.shape[-1], svh.shape[-1], suh=suh.contiguous(), svh=svh.contiguous(),
                      trellis=trellis.contiguous(), mcg=markers["mcg"], mul1=markers["mul1"], bias=bias,
                      out_dtype=out_dtype)


def _slice_mask(stack: ExpertStack) -> torch.Tensor | None:
    """The gate and up projections' svh [E, 2, I] with zeros outside the stack's intermediate slice, or None for a
    whole block range. Both: the clamped SwiGLU of a zero gate and a zero up is 0 · σ(0) · (0 + 1) = 0, while a
    live gate would give gate · σ(α · gate) · 1 there."""
    inter = stack.w13_svh.shape[-1]
    if (stack.inter_offset, stack.inter_size) == (0, inter):
        return None
    keep = torch.zeros(inter, dtype=stack.w13_svh.dtype, device=stack.w13_svh.device)
    keep[stack.inter_offset:stack.inter_offset + stack.inter_size] = 1
    return (stack.w13_svh * keep).contiguous()


class _RoutedByVllm:
    """Stands in for BlockSparseMLP's router: its presence makes forward call `routing_fn`, which returns the call's
    own ids and weights (`_given_routing`)."""


SELECTED, WEIGHTS = "vllm_exl3.selected_experts", "vllm_exl3.routing_weights"


def _given_routing(bsz, routing_cfg, z, params):
    return params[SELECTED], params[WEIGHTS]


def build(stack: ExpertStack, call: MoECall):
    """ExLlamaV3's BlockSparseMLP over the stack's tensors, loaded and ready (see the module docstring)."""
    from exllamav3.modules import Linear
    from exllamav3.modules.block_sparse_mlp import BlockSparseMLP

    top_k, activation = call.top_k, call.activation
    if not 1 <= top_k <= MAX_TOP_K:
        raise ValueError(f"top-k {top_k}: ExLlamaV3's BlockSparseMLP takes 1..{MAX_TOP_K} experts per token")
    limit, alpha = call.clamp
    if activation == "swigluoai" and alpha != EXLLAMAV3_ALPHA:
        raise ValueError(f"swigluoai alpha {alpha}: ExLlamaV3's swiglu_oai kernel computes with {EXLLAMAV3_ALPHA}")
    device = stack.w13_trellis.device
    experts, hidden, inter = stack.num_experts, stack.w13_suh.shape[-1], stack.w13_svh.shape[-1]
    w13_svh = _slice_mask(stack)

    def bias(e: int, proj: str) -> torch.Tensor | None:
        if stack.w13_bias is None:
            return None
        return stack.w2_bias[e] if proj == "down" else stack.w13_bias[e, W13.index(proj)]

    def linear(e: int, proj: str, out_dtype, **kw):
        w = stack.weights(e, proj)
        svh = w13_svh[e, W13.index(proj)] if proj in W13 and w13_svh is not None else w.svh
        lin = Linear(None, f"{KEY}.experts.{e}.{proj}", w.suh.shape[-1], svh.shape[-1], out_dtype=out_dtype, **kw)
        lin.inner = linear_exl3(w.trellis, w.suh, svh, w.codebook, out_dtype, bias(e, proj))
        lin.quant_type = "exl3"
        lin.device = device
        return lin

    # fp16 intermediates, as ExLlamaV3's own MoE models build the module (exllamav3/architecture/qwen3_moe.py): left
    # unset, its buffers take torch's default dtype, which vLLM sets to the model's while it loads, and a bf16 model's
    # load then died in BC_BlockSparseMLP ("gu_u is incorrect datatype, must be kHalf"; H200 serving run 3).
    gates = [linear(e, "gate", torch.half) for e in range(experts)]
    ups = [linear(e, "up", torch.half) for e in range(experts)]
    downs = [linear(e, "down", torch.float, allow_input_padding=True, trim_padded_out=True) for e in range(experts)]
    module = BlockSparseMLP(None, KEY, hidden_size=hidden, intermediate_size=inter, num_experts=experts + 1,
                            num_experts_per_tok=top_k, num_local_experts=experts,
                            activation_fn=ACTIVATION[activation], act_limit=limit if activation == "swigluoai" else 0.0,
                            gates=gates, ups=ups, downs=downs,
                            routing_first=0, routing_last=experts, interm_dtype=torch.half)
    module.device = device
    module.load_local()
    if missing := [a for a in MODULE_ATTRS if not hasattr(module, a)]:
        raise RuntimeError(f"ExLlamaV3's BlockSparseMLP lacks {', '.join(missing)} after load_local() (this backend "
                           "was written against ExLlamaV3 1.6.x)")
    if module.bc is None:
        raise RuntimeError(f"ExLlamaV3 did not build its quantized expert path for this layer ({experts} experts, "
                           f"hidden {hidden}, intermediate {inter}, {activation})")
    module.routing_gate = _RoutedByVllm()
    module.routing_fn = _given_routing
    return module


def forward(module, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor,
            expert_map: torch.Tensor | None, router_weight_on_input: bool) -> torch.Tensor:
    tokens, width = x.shape
    x16 = x.to(torch.float16)
    if width != module.hidden_size:
        x16 = zero_extend(x16, module.hidden_size, 0)
    ids = topk_ids.long()
    if expert_map is not None:
        ids = expert_map.long()[ids]  # -1: another rank's expert, outside [0, E): dropped by ExLlamaV3
    weights = topk_weights.to(torch.float16)
    if router_weight_on_input:  # top-1 models: scale the input, not the output
        x16 = x16 * weights
        weights = torch.ones_like(weights)
    x16 = x16.contiguous()
    if tokens <= MAX_DECODE_TOKENS or not torch.cuda.is_current_stream_capturing():
        y = module.forward(x16, {SELECTED: ids.contiguous(), WEIGHTS: weights.contiguous()})
    elif module.support_fused and module.fused_mode_buffers is not None:
        y = _fused_in_chunks(module, x16, ids, weights)
    else:
        y = _decode_in_chunks(module, x16, ids, weights)
    return y[:, :width].to(x.dtype)


def _decode_in_chunks(module, x16, ids, weights) -> torch.Tensor:
    """The fused decode kernels (`BC_BlockSparseMLP.run_bszN`) over chunks of MAX_DECODE_TOKENS tokens: capturable,
    any codebook. Each chunk's sum lands in ExLlamaV3's one static buffer and is copied out before the next."""
    out = torch.empty((x16.shape[0], module.hidden_size), dtype=torch.float32, device=x16.device)
    for s in range(0, x16.shape[0], MAX_DECODE_TOKENS):
        e = min(s + MAX_DECODE_TOKENS, x16.shape[0])
        module.bc.run_bszN(x16[s:e], ids[s:e].contiguous(), weights[s:e].contiguous())
        out[s:e].copy_(module.experts_cfg.out_bszn[:e - s])
    return out


def _fused_in_chunks(module, x16, ids, weights) -> torch.Tensor:
    """ExLlamaV3's fused expert kernel with the routing tables made on the device (no read-back), the tier its
    forward takes when no expert can exceed the kernel's row capacity (`fused_rows`; the kernel skips an expert
    with more rows). An expert gets at most one row per token (top-k picks distinct experts; picks outside the
    slice go to the sentinel bucket, which the kernel ignores), so chunks of `fused_rows` tokens are safe."""
    from exllamav3.ext import exllamav3_ext as ext
    from exllamav3.modules.block_sparse_mlp import FUSED_DET

    experts, top_k = module.num_local_experts, ids.shape[1]
    chunk = module.fused_rows
    bufs, mg, mu, md = module.fused_mode_buffers, module.multi_gate, module.multi_up, module.multi_down
    out = torch.empty((x16.shape[0], module.hidden_size), dtype=torch.float32, device=x16.device)
    for s in range(0, x16.shape[0], chunk):
        y = x16[s:s + chunk]
        rows = y.shape[0]
        flat = ids[s:s + chunk].reshape(-1)
        local = torch.where((flat >= 0) & (flat < experts), flat, torch.full_like(flat, experts))
        token = torch.arange(rows, device=y.device).repeat_interleave(top_k)
        order = local.argsort(stable=True)
        token_sorted, weight_sorted = token[order], weights[s:s + chunk].reshape(-1)[order]
        count = torch.zeros(experts + 1, dtype=torch.long, device=y.device).scatter_add_(0, local,
                                                                                        torch.ones_like(local))
        acc = torch.zeros((rows, module.hidden_size), dtype=torch.float32, device=y.device)
        scratch = tables = inv_order = None
        if FUSED_DET:
            start = count.cumsum(0) - count
            tables = torch.stack([start, start, (count > 0).long()])
            inv_order = torch.empty_like(order).scatter_(0, order, torch.arange(order.numel(), device=y.device))
            scratch = torch.empty((order.numel(), module.hidden_size), dtype=torch.float32, device=y.device)
        ext.exl3_moe(y, acc, count, token_sorted, weight_sorted, bufs.temp_state_g, bufs.temp_state_u,
                     bufs.temp_intermediate_g, bufs.temp_intermediate_u, module.activation_fn_idx, mg.K, mu.K, md.K,
                     mg.ptrs_trellis, mg.ptrs_suh, mg.ptrs_svh, mu.ptrs_trellis, mu.ptrs_suh, mu.ptrs_svh,
                     md.ptrs_trellis, md.ptrs_suh, md.ptrs_svh, mg.mcg, mg.mul1, mu.mcg, mu.mul1, md.mcg, md.mul1,
                     module.act_limit, -1, scratch, tables[0] if tables is not None else None, 1, module.fused_rows,
                     16)
        if FUSED_DET:
            ext.exl3_moe_gather(acc, scratch, local, inv_order, tables[1, :experts], tables[0, :experts],
                                tables[2, :experts], weight_sorted)
        out[s:s + rows].copy_(acc)
    return out
