"""A GLM-4.5 pack with its multi-token-prediction (MTP) layer, and what that layer drafts, computed on the pack's
decoded weights without vLLM.

`add_mtp_layer` copies a `Glm4MoeForCausalLM` pack that stores no MTP layer (the ExLlamaV3-made fixture) and writes
layer N = num_hidden_layers in the layout docs/speculative.md describes: `enorm`, `hnorm` and `shared_head.norm` plain,
`eh_proj` an EXL3 linear, then a whole routed decoder layer (attention, shared experts and routed experts EXL3, the
router and its correction bias plain), every linear at the pack's bits and codebook; no `embed_tokens` or
`shared_head.head` of its own (the drafter shares the target's). The decoder layer's linears are random (dev/
synthetic.py); `eh_proj` is encoded (dev/trellis.py) to pass the target's last hidden state through, ignoring the
token embedding: the layer then drafts about what the target itself predicted last, so it is accepted where the
target repeats a token (random models do, in loops). That makes a draft of the pack's own weights accepted often
where a random or unloaded draft is accepted almost never.

`draft_tokens` computes, for a token sequence, the token the MTP layer drafts at each position with the target's
hidden states of that same sequence (teacher-forced, as vLLM's drafter computes it over the verified tokens), with
transformers' GLM-4.5 classes on the weights `family_oracle.decoded_checkpoint` decodes from the pack.
"""

from __future__ import annotations

import json
import math
import shutil
import tempfile
from pathlib import Path

import torch

from ..format.pack import Pack
from .family_oracle import decoded_checkpoint
from .synthetic import linear_tensors, random_weights
from .trellis import encoded_weights

ARCHITECTURE = "Glm4MoeForCausalLM"
WEIGHT_SCALE = 0.02  # the decoder layer's random linears, at the size of the fixture's own (transformers' init)
PASS_THROUGH = 2.0  # eh_proj's tiles hold 2 · identity (well inside the codebooks' range) under suh = svh = 1/√2


def _decoder_linears(c: dict, qwen35: bool = False) -> dict[str, tuple[int, int]]:
    """(in, out) of every linear of the routed decoder layer an MTP layer holds, by name inside the layer: GLM-4.5's,
    or with `qwen35` Qwen3.5-MoE's (gated attention: q_proj twice as wide, query and gate; one `shared_expert`)."""
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    hd = c.get("head_dim") or h // heads
    inter = c["moe_intermediate_size"]
    if qwen35:
        shared, shared_name, experts = c.get("shared_expert_intermediate_size") or 0, "shared_expert", c["num_experts"]
    else:
        shared, shared_name, experts = inter * (c.get("n_shared_experts") or 0), "shared_experts", c["n_routed_experts"]
    out = {"self_attn.q_proj": (h, (2 if qwen35 else 1) * heads * hd), "self_attn.k_proj": (h, kv * hd),
           "self_attn.v_proj": (h, kv * hd), "self_attn.o_proj": (heads * hd, h)}
    if shared:
        out.update({f"mlp.{shared_name}.gate_proj": (h, shared), f"mlp.{shared_name}.up_proj": (h, shared),
                    f"mlp.{shared_name}.down_proj": (shared, h)})
    for e in range(experts):
        out.update({f"mlp.experts.{e}.gate_proj": (h, inter), f"mlp.experts.{e}.up_proj": (h, inter),
                    f"mlp.experts.{e}.down_proj": (inter, h)})
    return out


def pass_through(hidden: int, bits: int, codebook: str, half: str = "hidden") -> dict[str, torch.Tensor]:
    """The EXL3 tensors of an MTP layer's input projection (GLM's eh_proj, Qwen3.5's fc): the [embedding; hidden]
    input (2·hidden wide) -> one half of it (`half`: "hidden" or "embedding"). suh is 0 on the other half, so those
    rows decode to exactly 0; the chosen half decodes to the identity up to the trellis' error at `bits`."""
    weight = torch.zeros(2 * hidden, hidden)
    keep = slice(hidden, None) if half == "hidden" else slice(0, hidden)
    weight[keep] = torch.eye(hidden)
    scale = 1 / math.sqrt(PASS_THROUGH)
    suh = torch.zeros(2 * hidden)
    suh[keep] = scale
    return encoded_weights(weight, bits, codebook, suh, torch.full((hidden,), scale))


def add_mtp_layer(source: str | Path, dest: str | Path, seed: int = 0) -> Path:
    """`source` (a pack in one safetensors file, no MTP layer stored) copied to `dest` with one MTP layer in the
    layout ExLlamaV3 1.6.5 writes for its architecture (GLM-4.5: module docstring; Qwen3.5/3.6-MoE:
    `_add_qwen35_mtp_layer`); its config declares one MTP layer."""
    architecture = Pack.open(source).architecture
    if architecture == QWEN35:
        return _add_qwen35_mtp_layer(source, dest, seed)
    return _add_glm_mtp_layer(source, dest, seed)


def _add_glm_mtp_layer(source: str | Path, dest: str | Path, seed: int = 0) -> Path:
    """`source` (a GLM-4.5 pack in one safetensors file, no MTP layer stored) copied to `dest` with one MTP layer
    (module docstring); its config declares `num_nextn_predict_layers: 1`."""
    from safetensors.torch import load_file, save_file

    pack = Pack.open(source)
    if pack.architecture != ARCHITECTURE or len(pack.files) != 1:
        raise ValueError(f"{source}: a {ARCHITECTURE} pack in one safetensors file, not {pack.architecture} "
                         f"in {len(pack.files)}")
    c, qc = pack.config, pack.quantization_config
    n, h = c["num_hidden_layers"], c["hidden_size"]
    if any(name.startswith(f"model.layers.{n}.") for name in pack.tensors):
        raise ValueError(f"{source} already stores a layer {n}")
    bits, codebook = int(qc.get("bits", 4)), qc.get("codebook", "3inst")
    dest = Path(dest)
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("golden"))
    tensors = load_file(str(pack.files[0].path))
    g = torch.Generator().manual_seed(seed)
    layer = f"model.layers.{n}"
    for i, (name, (fan_in, fan_out)) in enumerate(sorted(_decoder_linears(c).items())):
        tensors.update(linear_tensors(f"{layer}.{name}", random_weights(fan_in, fan_out, bits, codebook,
                                                                        seed=seed * 7919 + i, scale=WEIGHT_SCALE)))
    experts = c["n_routed_experts"]
    tensors[f"{layer}.mlp.gate.weight"] = (torch.randn(experts, h, generator=g) * 2 / math.sqrt(h)).half()
    tensors[f"{layer}.mlp.gate.e_score_correction_bias"] = torch.randn(experts, generator=g) * 0.1
    for norm in ("input_layernorm", "post_attention_layernorm", "enorm", "hnorm", "shared_head.norm"):
        tensors[f"{layer}.{norm}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    if c.get("use_qk_norm"):
        hd = c.get("head_dim") or h // c["num_attention_heads"]
        for norm in ("self_attn.q_norm", "self_attn.k_norm"):
            tensors[f"{layer}.{norm}.weight"] = torch.ones(hd, dtype=torch.bfloat16)
    tensors.update(linear_tensors(f"{layer}.eh_proj", pass_through(h, bits, codebook)))
    save_file(tensors, str(dest / pack.files[0].path.name), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["num_nextn_predict_layers"] = 1
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest


QWEN35 = "Qwen3_5MoeForCausalLM"
MTP_BITS = 4  # ExLlamaV3 1.6.5's --mtp_bits default: every MTP linear at 4 bits whatever the trunk's rate


def _ledger_entry(tensors: dict[str, torch.Tensor], module: str, bits: float | None, codebook: str) -> dict:
    """The sidecar's `tensor_storage` entry ExLlamaV3 writes for one module's stored tensors."""
    stored = {n: {"shape": list(t.shape), "n_bytes": t.numel() * t.element_size(), "dtype": str(t.dtype)}
              for n, t in tensors.items() if n.rsplit(".", 1)[0] == module}
    entry: dict = {"stored_tensors": stored}
    if bits is not None:
        entry.update({"quant_format": "exl3", "bits_per_weight": bits})
        if codebook != "3inst":
            marker = int(tensors[f"{module}.{codebook}"]) & 0xFFFFFFFF
            entry[f"{codebook}_multiplier"] = marker
    return entry


def _add_qwen35_mtp_layer(source: str | Path, dest: str | Path, seed: int = 0) -> Path:
    """`source` (a Qwen3.5/3.6-MoE pack in one safetensors file, no MTP layer stored) copied to `dest` with the MTP
    module ExLlamaV3 1.6.5 writes for it (architecture/qwen3_5_mtp.py, modules/arch_specific/qwen3_5_mtp.py), under
    `mtp.` beside the trunk's `model.language_model.`: `mtp.pre_fc_norm_hidden`, `mtp.pre_fc_norm_embedding` and
    `mtp.norm` plain; `mtp.fc` ([embedding; hidden] -> hidden) an EXL3 linear at `mtp_bits`; `mtp.layers.0` a
    gated-attention routed decoder layer like the trunk's full-attention ones, attention, shared expert and routed
    experts EXL3 at `mtp_bits`, the router (`mlp.gate`) and `mlp.shared_expert_gate` plain fp16; no embedding or
    head of its own. Every linear at ExLlamaV3's default `mtp_bits` (4) and the pack's codebook; the config declares
    `mtp_num_hidden_layers: 1`, quantization_config `mtp_bits: 4`, and the sidecar's ledger records the new
    tensors. The decoder layer is random, `mtp.fc` passes the hidden state through (as GLM's eh_proj above). Norm
    weights are 0: Qwen3.5's norms scale by 1 + weight."""
    from safetensors.torch import load_file, save_file

    pack = Pack.open(source)
    if pack.architecture != QWEN35 or len(pack.files) != 1:
        raise ValueError(f"{source}: a {QWEN35} pack in one safetensors file, not {pack.architecture} "
                         f"in {len(pack.files)}")
    c, qc = pack.config, pack.quantization_config
    h = c["hidden_size"]
    if any(name.startswith("mtp.") for name in pack.tensors):
        raise ValueError(f"{source} already stores mtp.* tensors")
    codebook = qc.get("codebook", "3inst")
    dest = Path(dest)
    shutil.copytree(source, dest, ignore=shutil.ignore_patterns("golden"))
    tensors = load_file(str(pack.files[0].path))
    new: dict[str, torch.Tensor] = {}
    g = torch.Generator().manual_seed(seed)
    layer = "mtp.layers.0"
    exl3 = [f"{layer}.{name}" for name in _decoder_linears(c, qwen35=True)] + ["mtp.fc"]
    for i, (name, (fan_in, fan_out)) in enumerate(sorted(_decoder_linears(c, qwen35=True).items())):
        new.update(linear_tensors(f"{layer}.{name}", random_weights(fan_in, fan_out, MTP_BITS, codebook,
                                                                    seed=seed * 7919 + i, scale=WEIGHT_SCALE)))
    new[f"{layer}.mlp.gate.weight"] = (torch.randn(c["num_experts"], h, generator=g) * 2 / math.sqrt(h)).half()
    if c.get("shared_expert_intermediate_size"):
        new[f"{layer}.mlp.shared_expert_gate.weight"] = (torch.randn(1, h, generator=g) / math.sqrt(h)).half()
    norms = {f"{layer}.input_layernorm": h, f"{layer}.post_attention_layernorm": h, f"{layer}.self_attn.q_norm":
             c["head_dim"], f"{layer}.self_attn.k_norm": c["head_dim"], "mtp.pre_fc_norm_hidden": h,
             "mtp.pre_fc_norm_embedding": h, "mtp.norm": h}
    for norm, width in norms.items():
        new[f"{norm}.weight"] = torch.zeros(width, dtype=torch.bfloat16)
    new.update(linear_tensors("mtp.fc", pass_through(h, MTP_BITS, codebook, "embedding")))
    tensors.update(new)
    save_file(tensors, str(dest / pack.files[0].path.name), metadata={"format": "pt"})
    config = json.loads((dest / "config.json").read_text())
    config["mtp_num_hidden_layers"] = 1
    config["quantization_config"]["mtp_bits"] = MTP_BITS
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    sidecar = dest / "quantization_config.json"
    if sidecar.exists():
        side = json.loads(sidecar.read_text())
        side["mtp_bits"] = MTP_BITS
        ledger = side.setdefault("tensor_storage", {})
        for module in sorted({n.rsplit(".", 1)[0] for n in new}):
            ledger[module] = _ledger_entry(new, module, float(MTP_BITS) if module in exl3 else None, codebook)
        sidecar.write_text(json.dumps(side, indent=2))
    return dest


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * weight


def draft_tokens(pack_root: str | Path, sequences: list[list[int]]) -> list[list[int]]:
    """For each token sequence, the token the pack's MTP layer drafts after each position j < len - 1 (its guess for
    token j + 2): from the target's final-norm hidden state at j and the embedding of token j + 1 (zero at position
    0, as vLLM's GLM drafter has it), through enorm / hnorm, eh_proj, the decoder layer, shared_head.norm and the
    target's head. fp32 throughout."""
    import transformers
    from safetensors.torch import load_file

    with tempfile.TemporaryDirectory() as work:
        ckpt = decoded_checkpoint(pack_root, work)
        config = transformers.AutoConfig.from_pretrained(ckpt)
        n, eps = config.num_hidden_layers, config.rms_norm_eps
        target = transformers.AutoModelForCausalLM.from_pretrained(ckpt, dtype=torch.float32).eval()
        # the MTP layer's decoder block is a decoder layer like the others: transformers builds and loads it as
        # layer n of a model one layer deeper (its loader fuses the routed experts as it does for the others)
        config.num_hidden_layers = n + 1
        deeper = transformers.AutoModelForCausalLM.from_pretrained(ckpt, config=config, dtype=torch.float32).eval()
        raw = load_file(str(Path(ckpt) / "model.safetensors"))
    mtp = {k[len(f"model.layers.{n}."):]: v.float() for k, v in raw.items() if k.startswith(f"model.layers.{n}.")}
    block = deeper.model.layers[n]
    out = []
    with torch.no_grad():
        for token_ids in sequences:
            ids = torch.tensor([token_ids])
            hidden = target.model(ids).last_hidden_state[0, :-1]  # h_j, j < T - 1
            embeds = target.model.embed_tokens(ids)[0, 1:].clone()  # token j + 1
            embeds[0] = 0  # vLLM's drafter masks position 0
            x = torch.cat([_rms_norm(embeds, mtp["enorm.weight"], eps), _rms_norm(hidden, mtp["hnorm.weight"], eps)],
                          -1)
            x = (x @ mtp["eh_proj.weight"].t())[None]
            positions = torch.arange(x.shape[1])[None]
            x = block(x, position_ids=positions, position_embeddings=deeper.model.rotary_emb(x, positions))
            out.append(target.lm_head(_rms_norm(x[0], mtp["shared_head.norm.weight"], eps)).argmax(-1).tolist())
    return out
