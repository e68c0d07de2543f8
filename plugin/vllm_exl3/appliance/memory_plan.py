"""The unified-memory plan: which `--gpu-memory-utilization` and context length will boot on this machine.

On DGX Spark the GPU and the OS share 128 GiB. vLLM sizes everything from one fraction `u` of the device's total
memory: at start it refuses unless `u * total` is free ("Free memory on device ... is less than desired GPU memory
utilization"), then the KV cache gets `u * total` minus weights, peak activations and runtime overhead, and it
refuses again if one sequence of `--max-model-len` tokens does not fit. Both refusals come minutes into a boot.
This module makes the same arithmetic before the boot, from the pack's real byte counts and the model config,
and either returns flags that fit or a refusal that says what to change.

What "free" means on unified memory: the OS and the GPU draw on the same pages, and vLLM 0.32 itself takes
MemAvailable (free + reclaimable page cache) as the device's free memory on an integrated GPU
(vllm/utils/mem_utils.py, MemorySnapshot). The plan budgets from MemAvailable minus a host reserve (the preset's
`headroom-gib`: what the OS, the page cache a load creates and the container's own programs keep), counts
what the chosen backends hold besides KV (weights, peak activations, the MoE backend's workspace, CUDA graphs,
runtime overhead), and hands vLLM an exact `--kv-cache-memory-bytes` for the rest, so the KV cache is sized by
the plan and not by vLLM growing into a fraction of the whole machine. `--gpu-memory-utilization` is still passed:
vLLM refuses to start unless that fraction of the total is free (vllm/v1/worker/utils.py, request_memory); the
plan keeps it within the budget. The activation, graph and overhead terms are estimates; they are named inputs,
set per preset, so they can be calibrated on hardware.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ..format.geometry import ceil_to
from ..format.units import GIB, KIB, format_bytes
from ..kernels.backends.native_moe_limits import MOE_CHUNK_TOKENS
from .meminfo import read_meminfo

# vLLM allocates KV in blocks; planning to whole blocks keeps the promised context honest.
KV_BLOCK_TOKENS = 16
# A planned context is rounded down to this many tokens (the refusal names the exact figure).
CONTEXT_GRANULARITY = 256

# Bytes per KV element by `--kv-cache-dtype`; "auto" follows the model dtype.
KV_DTYPE_BYTES = {"auto": None, "bfloat16": 2, "float16": 2, "half": 2, "float32": 4,
                  "fp8": 1, "fp8_e4m3": 1, "fp8_e5m2": 1, "fp8_inc": 1, "fp8_ds_mla": 1}
MODEL_DTYPE_BYTES = {"bfloat16": 2, "float16": 2, "float32": 4}

# Activation-size factors for the estimate below: hidden-sized bf16 buffers alive at once in a step (residual,
# normed input, attention output, MoE input/output and their copies), and fp32 logits plus probabilities per
# sampled row. Deliberately generous: under-planning costs a failed 10-minute boot, over-planning a little KV.
HIDDEN_BUFFERS_PER_TOKEN = 10
LOGIT_BYTES_PER_VOCAB_ENTRY = 8
ACTIVATION_BYTES = 2


# Config keys vLLM reads a model's maximum length from (the smallest present wins), and the RoPE scalings whose
# factor extends it (YaRN and friends already carry the scaled length): vllm/config/model.py _get_and_verify_max_len.
MAX_LENGTH_KEYS = ("max_position_embeddings", "n_positions", "max_seq_len", "seq_length", "max_sequence_length",
                   "max_seq_length")
LENGTH_SCALING_ROPE_TYPES = ("linear", "dynamic")


def model_max_len(text_config: dict[str, Any], tokenizer_config: dict[str, Any] | None = None) -> int | None:
    """The longest context vLLM will accept for this model, as vLLM derives it from the configs. Values that are not
    finite positive numbers (a hand-edited config's NaN, Infinity or 1e400) say nothing and are skipped."""

    def usable(v) -> bool:
        return isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) and v > 0

    lengths = [int(text_config[k]) for k in MAX_LENGTH_KEYS if usable(text_config.get(k))]
    if not lengths:
        return None
    length = float(min(lengths))
    rope = text_config.get("rope_scaling") or text_config.get("rope_parameters") or {}
    if rope.get("rope_type", rope.get("type")) in LENGTH_SCALING_ROPE_TYPES and usable(rope.get("factor")):
        length *= float(rope["factor"])
    tokenizer_max = (tokenizer_config or {}).get("model_max_length")
    if usable(tokenizer_max):
        length = min(length, tokenizer_max)
    return int(length)


@dataclass(frozen=True)
class MemoryFigures:
    """Memory as the kernel reports it (bytes). On unified memory this is also the GPU's memory."""

    total: int
    free: int  # MemFree: what CUDA reports free
    available: int  # MemAvailable: free + reclaimable page cache

    @property
    def reclaimable(self) -> int:
        return max(0, self.available - self.free)

    @classmethod
    def from_meminfo(cls, path: str | Path = "/proc/meminfo") -> "MemoryFigures":
        fields = read_meminfo(path, ("MemTotal", "MemFree", "MemAvailable"))
        return cls(fields["MemTotal"], fields["MemFree"], fields["MemAvailable"])


@dataclass(frozen=True)
class PlanSettings:
    """The knobs a preset sets under [memory]. Sizes in GiB, as written in the preset files."""

    max_gpu_memory_utilization: float = 0.88  # Spark users report OOM / Xid 43 above ~0.9
    headroom_gib: float = 6.0  # the host reserve: left to the OS, the page cache a load creates, other programs
    runtime_overhead_gib: float = 3.0  # CUDA context, cuBLAS/NCCL workspaces, allocator slack
    cuda_graph_gib: float = 1.0  # captured CUDA graphs' memory pool (0 with --enforce-eager)
    min_context: int = 4096  # refuse rather than boot with less context than this

    @classmethod
    def from_table(cls, table: dict[str, Any]) -> "PlanSettings":
        known = {f.replace("_", "-"): f for f in cls.__dataclass_fields__}
        unknown = sorted(set(table) - set(known))
        if unknown:
            raise ValueError(f"unknown [memory] key(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
        return cls(**{known[k]: v for k, v in table.items()})


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs from a model: per-node weight bytes and the dims behind KV and activations."""

    weight_bytes: int  # whole model, all nodes
    largest_linear_bytes: int  # bf16 size of the largest single linear (a prefill kernel may reconstruct it)
    num_layers: int
    num_kv_heads: int
    head_dim: int
    hidden_size: int
    vocab_size: int
    max_position_embeddings: int | None
    dtype_bytes: int
    mla_kv_width: int | None = None  # kv_lora_rank + qk_rope_head_dim for MLA models (DeepSeek-style)
    moe_intermediate: int = 0
    experts_per_token: int = 0
    # vLLM's `mtp` drafter: the pack's own MTP layers, each with an attention layer and its KV cache (weight_bytes
    # then holds their tensors as stored; without the drafter vLLM loads neither)
    mtp_layers: int = 0
    mtp_weight_bytes: int = 0
    # vLLM's `eagle3`/`eagle` drafter: a separate head, its weights (as stored, in weight_bytes then) and its own
    # decoder layers' KV cache (their heads and head size are the head's, not the target's)
    draft_head_weight_bytes: int = 0
    draft_head_layers: int = 0
    draft_head_kv_heads: int = 0
    draft_head_dim: int = 0

    @classmethod
    def from_config(cls, text_config: dict[str, Any], weight_bytes: int, largest_linear_bytes: int = 0,
                    max_len: int | None = None, mtp_layers: int = 0, mtp_weight_bytes: int = 0) -> "ModelShape":
        tc = text_config
        heads = int(tc.get("num_attention_heads") or 1)
        head_dim = int(tc.get("head_dim") or tc["hidden_size"] // heads)
        mla = None
        if tc.get("kv_lora_rank"):
            mla = int(tc["kv_lora_rank"]) + int(tc.get("qk_rope_head_dim") or 0)
        dtype = str(tc.get("dtype") or tc.get("torch_dtype") or "bfloat16").replace("torch.", "")
        return cls(
            weight_bytes=weight_bytes,
            largest_linear_bytes=largest_linear_bytes,
            # MTP / next-n layers are loaded only by the `mtp` drafter: counted in mtp_layers then, never here
            num_layers=int(tc["num_hidden_layers"]),
            num_kv_heads=int(tc.get("num_key_value_heads") or heads),
            head_dim=head_dim,
            hidden_size=int(tc["hidden_size"]),
            vocab_size=int(tc.get("vocab_size") or 0),
            max_position_embeddings=max_len or model_max_len(tc),
            dtype_bytes=MODEL_DTYPE_BYTES.get(dtype, 2),
            mla_kv_width=mla,
            moe_intermediate=int(tc.get("moe_intermediate_size") or 0),
            experts_per_token=int(tc.get("num_experts_per_tok") or 0),
            mtp_layers=mtp_layers,
            mtp_weight_bytes=mtp_weight_bytes,
        )

    def kv_bytes_per_token(self, tp: int, kv_dtype: str = "auto") -> int:
        """KV bytes one token costs on one node (one TP rank per node on Spark)."""
        elem = KV_DTYPE_BYTES.get(kv_dtype)
        if elem is None:
            if kv_dtype not in KV_DTYPE_BYTES:
                raise ValueError(f"unknown --kv-cache-dtype {kv_dtype!r}; known: {', '.join(KV_DTYPE_BYTES)}")
            elem = self.dtype_bytes
        layers = self.num_layers + self.mtp_layers  # an MTP layer's attention is the trunk's shape
        # vLLM splits KV heads across TP ranks and replicates them when there are fewer heads than ranks (a draft
        # head's attention is a plain Llama one, whatever the target's).
        draft = self.draft_head_layers * 2 * max(1, math.ceil(self.draft_head_kv_heads / tp)) * self.draft_head_dim \
            * elem
        if self.mla_kv_width:  # MLA keeps one latent per token, replicated on every rank
            return layers * self.mla_kv_width * elem + draft
        heads_per_rank = max(1, math.ceil(self.num_kv_heads / tp))
        return layers * 2 * heads_per_rank * self.head_dim * elem + draft

    def moe_workspace_bytes(self, tp: int, max_num_batched_tokens: int) -> int:
        """The native MoE backend's one workspace per GPU, shared by every MoE layer (csrc/moe_planner.cpp,
        moe_workspace_layout): for up to MOE_CHUNK_TOKENS tokens per step, fp32 gate/up outputs, then the larger of
        the fp16 gate/up inputs and the fp16 down inputs plus fp32 per-(token, k) slots. Each fp16 input is held
        three times over: the plain copy and, for the decode-size GEMMs, a copy in duplicated fragment order at
        twice the bytes (csrc/moe.h moe_xdup; a layer mixing codebooks writes both). The experts themselves
        stay packed: the backend keeps no 16-bit copy."""
        if not (self.moe_intermediate and self.experts_per_token):
            return 0
        pairs = min(max_num_batched_tokens, MOE_CHUNK_TOKENS) * self.experts_per_token
        inter = ceil_to(-(-self.moe_intermediate // tp))
        hidden = ceil_to(self.hidden_size)
        copies = 3
        gate_up_inputs, down_inputs = copies * pairs * 2 * hidden * 2, copies * pairs * inter * 2
        return pairs * 2 * inter * 4 + max(gate_up_inputs, down_inputs + pairs * hidden * 4)

    def activation_bytes(self, tp: int, max_num_batched_tokens: int, max_num_seqs: int) -> int:
        """Peak activation estimate of one engine step at the full token budget (vLLM's profiling run)."""
        per_token = HIDDEN_BUFFERS_PER_TOKEN * self.hidden_size
        per_token += 2 * self.experts_per_token * self.moe_intermediate // tp  # routed gate_up outputs
        logits = max_num_seqs * self.vocab_size * LOGIT_BYTES_PER_VOCAB_ENTRY
        return max_num_batched_tokens * per_token * ACTIVATION_BYTES + logits + self.largest_linear_bytes // tp


@dataclass(frozen=True)
class Request:
    """What the launch asks for. None = let the plan choose."""

    tp: int = 1
    max_model_len: int | None = None  # the preset's wish; capped by memory and the model
    max_model_len_pinned: bool = False  # the user set it explicitly: refuse rather than shrink it
    gpu_memory_utilization: float | None = None  # explicit user value: check it instead of choosing
    kv_cache_memory_bytes: int | None = None  # explicit user value: check it instead of choosing
    enforce_eager: bool = False  # no CUDA graphs
    kv_cache_dtype: str = "auto"
    max_num_batched_tokens: int = 2048  # vLLM's default on GB10 (API server)
    max_num_seqs: int = 256


@dataclass
class Plan:
    """The outcome. `fits` False means refuse: `problems` says why and `advice` what to change."""

    fits: bool
    gpu_memory_utilization: float
    max_model_len: int
    kv_tokens: int
    kv_cache_memory_bytes: int = 0
    lines: list[str] = field(default_factory=list)  # the arithmetic, for the log
    problems: list[str] = field(default_factory=list)
    advice: list[str] = field(default_factory=list)
    weights_bytes: int = 0  # per node (the metrics exporter shows them next to what was allocated)

    def flags(self) -> dict[str, Any]:
        return {"gpu-memory-utilization": self.gpu_memory_utilization, "max-model-len": self.max_model_len,
                "kv-cache-memory-bytes": self.kv_cache_memory_bytes}


def gib(n: float) -> str:
    """A byte count for people: GiB with one decimal, MiB below 1 GiB (tiny test packs stay readable)."""
    return format_bytes(n, binary=True, digits=1)


def plan(mem: MemoryFigures, model: ModelShape, req: Request, settings: PlanSettings) -> Plan:
    tp = max(1, req.tp)
    weights = math.ceil(model.weight_bytes / tp)  # every sharded group splits evenly across the TP ranks
    activations = model.activation_bytes(tp, req.max_num_batched_tokens, req.max_num_seqs)
    workspace = model.moe_workspace_bytes(tp, req.max_num_batched_tokens)
    graphs = 0 if req.enforce_eager else int(settings.cuda_graph_gib * GIB)
    overhead = int(settings.runtime_overhead_gib * GIB)
    reserve = int(settings.headroom_gib * GIB)
    kv_per_token = model.kv_bytes_per_token(tp, req.kv_cache_dtype)
    fixed = weights + activations + workspace + graphs + overhead
    usable = mem.available - reserve  # what vLLM may take without pressing the host

    lines = [f"memory: total {gib(mem.total)}, available {gib(mem.available)} (free {gib(mem.free)} + "
             f"reclaimable {gib(mem.reclaimable)}), host reserve {gib(reserve)} -> {gib(max(usable, 0))} usable",
             f"weights {gib(weights)} per node (TP {tp}), activations ~{gib(activations)}, MoE workspace "
             f"{gib(workspace)}, CUDA graphs ~{gib(graphs)}, runtime overhead ~{gib(overhead)}",
             f"KV {kv_per_token / KIB:.1f} KiB per token ({req.kv_cache_dtype})"]
    if model.mtp_layers:
        lines.append(f"mtp drafts: {model.mtp_layers} MTP layer(s), {gib(math.ceil(model.mtp_weight_bytes / tp))} "
                     f"of their weights per node (in the weights above) and their KV (in the KV per token)")
    if model.draft_head_layers:
        lines.append(f"draft head: {model.draft_head_layers} layer(s), {gib(model.draft_head_weight_bytes)} of "
                     "weights as stored (in the weights above) and their KV (in the KV per token)")
    problems: list[str] = []

    fitting_util = math.floor(max(usable, 0) / mem.total * 100) / 100
    if req.gpu_memory_utilization is not None:
        util = req.gpu_memory_utilization
        if util * mem.total > usable:
            problems.append(f"--gpu-memory-utilization {util} asks for {gib(util * mem.total)} but only "
                            f"{gib(mem.available)} is available, {gib(max(usable, 0))} after the host reserve"
                            + (": vLLM refuses at start" if util * mem.total > mem.available else ""))
    else:
        util = min(settings.max_gpu_memory_utilization, fitting_util)
    budget = int(max(util, 0.0) * mem.total)
    kv_room = budget - fixed
    kv_bytes = kv_room if req.kv_cache_memory_bytes is None else req.kv_cache_memory_bytes
    if req.kv_cache_memory_bytes is not None and req.kv_cache_memory_bytes > kv_room:
        problems.append(f"--kv-cache-memory-bytes {req.kv_cache_memory_bytes} ({gib(req.kv_cache_memory_bytes)}) "
                        f"does not fit: {gib(max(kv_room, 0))} is left for KV")
    kv_tokens = max(0, kv_bytes // kv_per_token // KV_BLOCK_TOKENS * KV_BLOCK_TOKENS)
    kv_exact = kv_tokens * kv_per_token  # whole blocks: what vLLM is handed
    lines.append(f"budget {gib(budget)} (--gpu-memory-utilization {util:.2f}), {gib(max(kv_room, 0))} left for "
                 f"KV = {kv_tokens} tokens")

    model_max = model.max_position_embeddings or req.max_model_len or kv_tokens
    wanted = min(req.max_model_len or model_max, model_max)
    if kv_tokens >= wanted:
        max_len = wanted
    else:
        max_len = kv_tokens // CONTEXT_GRANULARITY * CONTEXT_GRANULARITY or kv_tokens
    floor = min(settings.min_context, wanted)
    if kv_room <= 0:
        problems.append(f"weights + activations + workspace + graphs + overhead ({gib(fixed)}) exceed the "
                        f"{gib(budget)} vLLM may use")
    elif req.max_model_len_pinned and req.max_model_len and kv_tokens < req.max_model_len:
        problems.append(f"--max-model-len {req.max_model_len} needs {gib(req.max_model_len * kv_per_token)} of KV, "
                        f"only {gib(kv_bytes)} fits: vLLM refuses at start")
    elif max_len < floor:
        problems.append(f"only {max_len} tokens of context fit, below the preset's minimum of {floor}")

    advice: list[str] = []
    if problems:
        need = fixed + floor * kv_per_token
        lines.append(f"to boot with {floor} tokens: {gib(need)} needed, {gib(budget)} available to vLLM "
                     f"(short by {gib(max(need - budget, 0))})")
        if req.gpu_memory_utilization is not None and util * mem.total > usable:
            advice.append(f"lower --gpu-memory-utilization to {fitting_util:.2f} or less, or leave it to the plan")
        advice.append("stop other GPU/memory users on this machine (`nvidia-smi`, `free -g`)")
        if reserve > 2 * GIB:  # page cache is already counted as available: dropping it gains nothing here
            advice.append(f"lower the preset's [memory] headroom-gib (the {gib(reserve)} host reserve) if this "
                          "box runs nothing else")
        kv_bound = kv_room > 0  # the fixed costs fit: it is the context that does not
        if kv_bound and req.kv_cache_dtype in ("auto", "bfloat16", "float16", "half") and model.dtype_bytes >= 2:
            advice.append("halve KV per token with `--kv-cache-dtype fp8` (preset long-context does)")
        if kv_bound and req.max_model_len_pinned:
            advice.append(f"lower --max-model-len (about {max(kv_tokens, 0)} tokens fit now)")
        elif kv_bound:
            advice.append("lower the preset's [memory] min-context if less context is acceptable")
        if tp == 1:
            advice.append("split the model over two Sparks (roles head + worker, TP 2): weights per node halve")
        advice.append("use a smaller pack (fewer bits per weight)")
    else:
        lines.append(f"plan: --gpu-memory-utilization {util:.2f} --kv-cache-memory-bytes {kv_exact} "
                     f"({gib(kv_exact)}) --max-model-len {max_len} "
                     f"({kv_tokens // max(max_len, 1)} full-length sequences fit in KV)")
    return Plan(not problems, round(util, 2), max_len, kv_tokens, kv_exact, lines, problems, advice, weights)
