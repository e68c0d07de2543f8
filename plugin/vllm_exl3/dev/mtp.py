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


def _decoder_linears(c: dict) -> dict[str, tuple[int, int]]:
    """(in, out) of every linear of GLM-4.5's routed decoder layer, by name inside the layer."""
    h, heads, kv = c["hidden_size"], c["num_attention_heads"], c.get("num_key_value_heads") or c["num_attention_heads"]
    hd = c.get("head_dim") or h // heads
    inter, shared = c["moe_intermediate_size"], c["moe_intermediate_size"] * (c.get("n_shared_experts") or 0)
    out = {"self_attn.q_proj": (h, heads * hd), "self_attn.k_proj": (h, kv * hd), "self_attn.v_proj": (h, kv * hd),
           "self_attn.o_proj": (heads * hd, h)}
    if shared:
        out.update({"mlp.shared_experts.gate_proj": (h, shared), "mlp.shared_experts.up_proj": (h, shared),
                    "mlp.shared_experts.down_proj": (shared, h)})
    for e in range(c["n_routed_experts"]):
        out.update({f"mlp.experts.{e}.gate_proj": (h, inter), f"mlp.experts.{e}.up_proj": (h, inter),
                    f"mlp.experts.{e}.down_proj": (inter, h)})
    return out


def pass_through(hidden: int, bits: int, codebook: str) -> dict[str, torch.Tensor]:
    """eh_proj's EXL3 tensors: the [embedding; hidden] input (2·hidden wide) -> the hidden half. suh is 0 on the
    embedding half, so those rows decode to exactly 0; the hidden half decodes to the identity up to the trellis'
    error at `bits`."""
    weight = torch.zeros(2 * hidden, hidden)
    weight[hidden:] = torch.eye(hidden)
    scale = 1 / math.sqrt(PASS_THROUGH)
    suh = torch.full((2 * hidden,), scale)
    suh[:hidden] = 0
    return encoded_weights(weight, bits, codebook, suh, torch.full((hidden,), scale))


def add_mtp_layer(source: str | Path, dest: str | Path, seed: int = 0) -> Path:
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
