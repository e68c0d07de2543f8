"""The second oracle, on the CPU and without ExLlamaV3: transformers' own model class of a family, run on the weights
an EXL3 pack decodes to.

`write_pack` builds a tiny randomly initialised model of the family with transformers, writes it as an EXL3 pack in
the layout ExLlamaV3's converter writes for that family (its names, splits and orders: `to_exl3_layout`; the
linears it keeps 16-bit stay plain, every other linear becomes a random EXL3 linear of the same shape), and
`oracle_logits` decodes the pack with the bit-exact reference (format/reference.py), puts the weights back into
transformers' layout (`from_exl3_layout`), loads them with `from_pretrained` (transformers fuses what it fuses on
load) and returns the logits. vLLM serving the pack through the plugin must agree with them: the activation, the
biases, the routing, the attention variant are transformers' implementation, not ours.

Random trellis tiles are valid EXL3 linears (dev/synthetic.py); what the pack decodes to *is* the model.
"""

from __future__ import annotations

import json
import shutil
import tempfile
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from ..format.families import family_of
from ..format.pack import Pack
from ..format.reference import full_weight
from ..format.tensors import load_weights
from .synthetic import linear_tensors, random_weights, write_pack as write_tensors

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json")


@dataclass(frozen=True)
class Geometry:
    """A tiny model's dims (the vocabulary is the fixture tokenizer's)."""

    hidden: int = 256
    heads: int = 4
    kv_heads: int = 2
    head_dim: int = 64
    layers: int = 3
    experts: int = 8
    top_k: int = 2
    moe_inter: int = 128
    inter: int = 512
    vocab: int = 2048


COMMON = dict(max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=0, eos_token_id=2,
              pad_token_id=0, rms_norm_eps=1e-6)


def _attention(g: Geometry, head_dim: bool = True) -> dict[str, Any]:
    out = dict(vocab_size=g.vocab, hidden_size=g.hidden, num_attention_heads=g.heads, num_key_value_heads=g.kv_heads,
               num_hidden_layers=g.layers, **COMMON)
    if head_dim:
        out["head_dim"] = g.head_dim
    return out


def _hybrid(g: Geometry) -> dict[str, Any]:
    layers = max(g.layers, 4)  # a full-attention layer every 4th
    return dict(_attention(g), num_hidden_layers=layers,
                layer_types=["linear_attention" if (i + 1) % 4 else "full_attention" for i in range(layers)],
                linear_conv_kernel_dim=4, linear_key_head_dim=64, linear_value_head_dim=64,
                linear_num_key_heads=2, linear_num_value_heads=4, moe_intermediate_size=g.moe_inter,
                shared_expert_intermediate_size=g.moe_inter, num_experts=g.experts, num_experts_per_tok=g.top_k)


# Per architecture: transformers' config class and its arguments for geometry `g`, with the keys the released
# checkpoints' config.json carry beside them (vLLM reads some of those with no default: format/families/).
SOURCES: dict[str, tuple[str, Callable[[Geometry], dict[str, Any]], dict[str, Any]]] = {
    "Qwen3MoeForCausalLM": ("Qwen3MoeConfig", lambda g: dict(
        _attention(g), intermediate_size=g.inter, moe_intermediate_size=g.moe_inter, num_experts=g.experts,
        num_experts_per_tok=g.top_k, norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[]), {}),
    "MixtralForCausalLM": ("MixtralConfig", lambda g: dict(
        _attention(g), intermediate_size=g.moe_inter, num_local_experts=g.experts, num_experts_per_tok=g.top_k), {}),
    "MiniMaxM2ForCausalLM": ("MiniMaxM2Config", lambda g: dict(
        _attention(g), intermediate_size=g.moe_inter, num_local_experts=g.experts, num_experts_per_tok=g.top_k),
        # MiniMax-M2's config.json: partial rotary as rotary_dim, a sigmoid router with a correction bias
        {"rotary_dim": 32, "scoring_func": "sigmoid", "use_routing_bias": True, "use_qk_norm": True,
         "qk_norm_type": "per_layer"}),
    "Ernie4_5_MoeForCausalLM": ("Ernie4_5_MoeConfig", lambda g: dict(
        _attention(g, head_dim=False), intermediate_size=g.inter, moe_intermediate_size=g.moe_inter,
        moe_num_experts=g.experts, moe_k=g.top_k, moe_num_shared_experts=1, moe_layer_start_index=1,
        moe_layer_end_index=g.layers - 1, moe_layer_interval=1, use_bias=False), {}),
    "GptOssForCausalLM": ("GptOssConfig", lambda g: dict(
        # released gpt-oss: eps 1e-5 (vLLM's GptOss uses it whatever the config says), YaRN's factor 32 over a
        # 4096-token original context
        _attention(g), rms_norm_eps=1e-5, max_position_embeddings=131072,
        intermediate_size=g.moe_inter, num_local_experts=g.experts, num_experts_per_tok=g.top_k,
        sliding_window=8, layer_types=["sliding_attention" if i % 2 == 0 else "full_attention"
                                       for i in range(g.layers)]), {}),
    "Glm4MoeLiteForCausalLM": ("Glm4MoeLiteConfig", lambda g: dict(
        # GLM-4.7-Flash's latent (512 + 64 rope = 576: the width vLLM's MLA serves) and head dims (192 + 64 rope
        # for q·k, 256 for v: dims vLLM's GPU MLA prefill kernels take), one K/V head per query head
        _attention(g, head_dim=False), num_key_value_heads=g.heads, intermediate_size=g.inter,
        moe_intermediate_size=g.moe_inter, n_routed_experts=g.experts, n_shared_experts=1,
        num_experts_per_tok=g.top_k, kv_lora_rank=512, q_lora_rank=128, qk_nope_head_dim=192, qk_rope_head_dim=64,
        v_head_dim=256, n_group=1, topk_group=1, routed_scaling_factor=1.0, norm_topk_prob=True,
        mlp_layer_types=["dense"] + ["sparse"] * (g.layers - 1)),
        {"first_k_dense_replace": 1}),
    "Qwen3NextForCausalLM": ("Qwen3NextConfig", lambda g: dict(
        _hybrid(g), intermediate_size=g.inter, decoder_sparse_step=1, norm_topk_prob=True), {}),
    "Qwen3_5MoeForCausalLM": ("Qwen3_5MoeTextConfig", _hybrid, {}),
}

# Linears ExLlamaV3's converter stores 16-bit (`.weight`) rather than as EXL3 (read off its packs): routers, the
# shared expert's gate, the delta net's small a/b projections, MLA's kv_b_proj.
KEPT_PLAIN = ("mlp.gate", "mlp.router", "block_sparse_moe.gate", "mlp.shared_expert_gate", "linear_attn.in_proj_ba",
              "linear_attn.in_proj_a", "linear_attn.in_proj_b", "self_attn.kv_b_proj")
QWEN35_PREFIX = "model.language_model."


def to_exl3_layout(architecture: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A checkpoint as transformers saves it -> the names, splits and orders ExLlamaV3's converter writes.

    gpt-oss: each layer's fused `experts.gate_up_proj` [E, H, 2I] (gate and up interleaved by column) and
    `down_proj` [E, I, H], with their `_bias`, become per-expert `experts.<e>.gate_proj` / `up_proj` / `down_proj`
    linears ([out, in] weights, the bias as each linear's `.bias`: how ExLlamaV3 writes an MXFP4 source's).
    Qwen3.5-MoE: the text model under `model.language_model.` (ExLlamaV3 1.6.5 reads it there)."""
    out = dict(tensors)
    if architecture == "GptOssForCausalLM":
        for name in [n for n in tensors if n.endswith(".mlp.experts.gate_up_proj")]:
            stem = name[: -len("gate_up_proj")]
            gate_up, bias = out.pop(name), out.pop(f"{stem}gate_up_proj_bias")
            down, down_bias = out.pop(f"{stem}down_proj"), out.pop(f"{stem}down_proj_bias")
            for e in range(gate_up.shape[0]):
                for proj, cols in (("gate_proj", slice(0, None, 2)), ("up_proj", slice(1, None, 2))):
                    out[f"{stem}{e}.{proj}.weight"] = gate_up[e][:, cols].t().contiguous()
                    out[f"{stem}{e}.{proj}.bias"] = bias[e][cols].contiguous()
                out[f"{stem}{e}.down_proj.weight"] = down[e].t().contiguous()
                out[f"{stem}{e}.down_proj.bias"] = down_bias[e].contiguous()
    if architecture == "Qwen3_5MoeForCausalLM":
        out = {QWEN35_PREFIX + n[len("model."):] if n.startswith("model.") else n: t for n, t in out.items()}
    return out


def from_exl3_layout(architecture: str, tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """`to_exl3_layout`'s inverse: what transformers' `from_pretrained` loads."""
    out = dict(tensors)
    if architecture == "GptOssForCausalLM":
        stems = sorted({n.split(".experts.")[0] for n in tensors if ".mlp.experts." in n})
        for stem in stems:
            experts = sorted({int(n.split(".experts.")[1].split(".")[0]) for n in tensors
                              if n.startswith(f"{stem}.experts.")})
            gate_up, gate_up_bias, down, down_bias = [], [], [], []
            for e in experts:
                p = f"{stem}.experts.{e}."
                g, u = out.pop(p + "gate_proj.weight").t(), out.pop(p + "up_proj.weight").t()
                gate_up.append(torch.stack((g, u), dim=-1).flatten(-2))  # [H, 2I], interleaved
                gb, ub = out.pop(p + "gate_proj.bias", None), out.pop(p + "up_proj.bias", None)
                zeros = torch.zeros(g.shape[1])
                gate_up_bias.append(torch.stack((zeros if gb is None else gb.float(),
                                                 zeros if ub is None else ub.float()), dim=-1).flatten())
                down.append(out.pop(p + "down_proj.weight").t())
                db = out.pop(p + "down_proj.bias", None)
                down_bias.append(torch.zeros(down[-1].shape[1]) if db is None else db.float())
            out[f"{stem}.experts.gate_up_proj"] = torch.stack(gate_up).contiguous()
            out[f"{stem}.experts.gate_up_proj_bias"] = torch.stack(gate_up_bias).contiguous()
            out[f"{stem}.experts.down_proj"] = torch.stack(down).contiguous()
            out[f"{stem}.experts.down_proj_bias"] = torch.stack(down_bias).contiguous()
    if architecture == "Qwen3_5MoeForCausalLM":
        out = {"model." + n[len(QWEN35_PREFIX):] if n.startswith(QWEN35_PREFIX) else n: t for n, t in out.items()}
    return out


def source_model(architecture: str, g: Geometry, seed: int):
    """transformers' model of `architecture` at geometry `g`, randomly initialised, and its config as the pack's
    config.json will hold it. Routers get weights of a scale that decides between experts (some families initialise
    them to zero, where every expert ties and only a tie-break picks)."""
    import transformers

    cls_name, kwargs, released = SOURCES[architecture]
    torch.manual_seed(seed)
    config = getattr(transformers, cls_name)(**kwargs(g))
    config.architectures = [architecture]
    model = transformers.AutoModelForCausalLM.from_config(config, dtype=torch.float32).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith(("mlp.gate.weight", "mlp.router.weight", "block_sparse_moe.gate.weight")):
                p.normal_(0, 2.0 / g.hidden ** 0.5)
            elif name.endswith(("e_score_correction_bias", "router.bias", "_bias")) and "experts" in name or \
                    name.endswith(("e_score_correction_bias", "router.bias")):
                p.normal_(0, 0.1)
    return model, released


# The size of the random EXL3 linears' weights: transformers' initializer_range, as the tiny source models ExLlamaV3
# converts have them. Unit-gain weights (1/sqrt(in)) make a random model's activations grow layer over layer, and a
# bf16 server (vLLM's CPU build runs the gated delta net in bf16 only) then parts from the fp32 oracle by more than
# bf16's resolution (Qwen3-Next: median |Δ log p| 0.050 against 0.011 at this scale).
WEIGHT_SCALE = 0.02


def write_pack(architecture: str, root: str | Path, tokenizer_dir: str | Path, g: Geometry = Geometry(),
               bits: float = 4, codebook: str = "mul1", seed: int = 0, weight_scale: float = WEIGHT_SCALE) -> Path:
    """A pack of `architecture` in ExLlamaV3's layout (module docstring): its linears random EXL3 linears of
    `bits` and `codebook` with weights of about `weight_scale`, everything else transformers' random init, plus the
    fixture tokenizer."""
    root = Path(root)
    model, released = source_model(architecture, g, seed)
    with tempfile.TemporaryDirectory() as tmp:
        model.save_pretrained(tmp)  # transformers' checkpoint layout (it un-fuses what it fuses in memory)
        from safetensors.torch import load_file

        saved = {}
        for f in sorted(Path(tmp).glob("*.safetensors")):
            saved.update(load_file(f))
        config = json.loads((Path(tmp) / "config.json").read_text())
    config.update(released)
    tensors = to_exl3_layout(architecture, saved)
    table = family_of(architecture).architectures[architecture]
    linears = {prefix for prefix, module in table.modules(config.get("text_config") or config) if module.linear}
    out: dict[str, torch.Tensor] = {}
    n = 0
    for name, t in sorted(tensors.items()):
        prefix, _, suffix = name.rpartition(".")
        if prefix in linears and suffix == "weight" and not prefix.endswith(KEPT_PLAIN):
            w = random_weights(t.shape[1], t.shape[0], bits, codebook, seed=seed * 100003 + n, scale=weight_scale)
            n += 1
            bias = tensors.get(f"{prefix}.bias")
            if bias is not None:
                w.bias = bias.half()
            out.update(linear_tensors(prefix, w))
        elif not (suffix == "bias" and prefix in linears and not prefix.endswith(KEPT_PLAIN)):
            out[name] = t.half() if prefix.endswith(KEPT_PLAIN) and suffix == "weight" else t.to(torch.bfloat16)
    config["quantization_config"] = {"quant_method": "exl3", "version": "vllm-exl3 family oracle", "bits": bits,
                                     "head_bits": bits, "codebook": codebook}
    write_tensors(root, out, config)
    for f in TOKENIZER_FILES:
        shutil.copy(Path(tokenizer_dir) / f, root / f)
    return root


def decoded_checkpoint(pack_root: str | Path, dest: str | Path) -> Path:
    """The pack's weights decoded (fp32) in transformers' layout, with its config, at `dest`: what
    `from_pretrained` loads."""
    from safetensors.torch import load_file, save_file

    pack, dest = Pack.open(pack_root), Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    tensors: dict[str, torch.Tensor] = {}
    for f in pack.files:
        tensors.update(load_file(f.path))
    for prefix, lin in pack.linears().items():
        for r in lin.records:
            tensors.pop(r.name, None)
        w = load_weights(lin)
        tensors[f"{prefix}.weight"] = full_weight(w).t()  # [out, in], padded: cut below where the model's is less
        if w.bias is not None:
            tensors[f"{prefix}.bias"] = w.bias.float()
    shapes = _model_shapes(pack.config)
    for name, t in tensors.items():  # a padded linear (GLM's 576-wide latent stored as 640) cut to the model's
        if name in shapes and t.shape != shapes[name] and all(s <= p for s, p in zip(shapes[name], t.shape)):
            tensors[name] = t[tuple(slice(0, s) for s in shapes[name])]
    tensors = from_exl3_layout(pack.architecture, {n: t.float() for n, t in tensors.items()})
    config = dict(pack.config)
    config.pop("quantization_config", None)
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    save_file({n: t.contiguous() for n, t in tensors.items()}, str(dest / "model.safetensors"),
              metadata={"format": "pt"})
    return dest


def _model_shapes(config: dict[str, Any]) -> dict[str, torch.Size]:
    """The shapes of the parameters transformers' model of `config` has, by name (built without memory)."""
    import transformers

    config = {k: v for k, v in config.items() if k != "quantization_config"}
    with torch.device("meta"):
        model = transformers.AutoModelForCausalLM.from_config(
            transformers.AutoConfig.for_model(config.pop("model_type"), **config))
    return {n: p.shape for n, p in model.state_dict().items()}


# The geometry the oracle packs are checked at: another than the ExLlamaV3-made fixtures' (tests/fixtures/
# exl3-families), with more experts than top-k routes to and a hidden width that is not a power of two.
HELD_OUT = Geometry(hidden=384, heads=6, kv_heads=2, head_dim=64, layers=3, experts=16, top_k=4, moe_inter=256,
                    inter=768)
# The families checked against transformers (ERNIE's and gpt-oss's ExLlamaV3-made fixtures cannot be: their
# PROVENANCE.md says why), in the order the suites run them.
ORACLE_ARCHITECTURES = ("Ernie4_5_MoeForCausalLM", "GptOssForCausalLM", "MiniMaxM2ForCausalLM",
                        "Glm4MoeLiteForCausalLM", "Qwen3NextForCausalLM", "Qwen3_5MoeForCausalLM")


def oracle_fixture(architecture: str, root: str | Path, tokenizer_dir: str | Path) -> Path:
    """A pack of `architecture` at HELD_OUT (3-bit mcg) with transformers' logits in the fixtures' own layout
    (`golden/logits.safetensors`: input_ids [2, 40], fp32 logits), so every golden check takes it as it takes an
    ExLlamaV3-made pack. Deterministic: the same seeds each time."""
    from safetensors.torch import save_file

    root = Path(root)
    pack = write_pack(architecture, root / "pack", tokenizer_dir, HELD_OUT, bits=3, codebook="mcg", seed=7)
    ids = torch.randint(3, HELD_OUT.vocab, (2, 40), generator=torch.Generator().manual_seed(1))
    ids[:, 0] = 1
    with tempfile.TemporaryDirectory() as work:
        logits = oracle_logits(pack, ids, work)
    (pack / "golden").mkdir(exist_ok=True)
    save_file({"input_ids": ids.contiguous(), "logits": logits.contiguous()}, str(pack / "golden" / "logits.safetensors"))
    return pack


def oracle_logits(pack_root: str | Path, input_ids: torch.Tensor, work: str | Path) -> torch.Tensor:
    """transformers' fp32 logits [B, T, V] for `input_ids` on the pack's decoded weights."""
    import transformers

    ckpt = decoded_checkpoint(pack_root, work)
    model = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        return model(input_ids).logits.float()
