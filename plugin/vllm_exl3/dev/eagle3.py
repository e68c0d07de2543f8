"""A bf16 EAGLE-3 draft head for a pack's geometry, in the layout vLLM's `Eagle3LlamaForCausalLM` loads
(docs/vllm-notes.md §10), for serving an EXL3 target with
`--speculative-config '{"method": "eagle3", "model": HEAD, ...}'`.

The head is one Llama decoder layer (`midlayer.*`, its q/k/v projection taking [token embedding; hidden], twice the
hidden width), `fc` (the target's three auxiliary hidden states concatenated -> hidden), `norm`, and no
`embed_tokens` or `lm_head` of its own: vLLM then shares the target's (the log says "without its own lm_head"), so
the draft vocabulary is the target's and no `d2t`/`t2d` map is written. Its config names the target's layers whose
hidden states it reads (`eagle_aux_hidden_state_layer_ids`, at its top level, where every vLLM model runner reads
them): vLLM's default for a model without them, (2, n // 2, n - 3), names layers a small model lacks.

The weights are chosen so that the draft is accepted where the target repeats a token, like dev/mtp.py's MTP
layer: the last auxiliary state is the target's residual stream after its last layer (aux id n), `fc` passes it
through (an identity on that third of its input, zeros elsewhere), the decoder layer's `o_proj` and `down_proj`
are zero so the layer adds nothing to that residual, and `norm` is the target's final norm: the draft's logits at a
position are then the target's own there, so it drafts the token the target has just produced. The layer's other
linears are random (they must still load and run). Everything is stored bf16, as real heads are.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch

from ..format.pack import Pack

ARCHITECTURE = "LlamaForCausalLMEagle3"  # the name EAGLE-3 heads ship with; vLLM maps it to Eagle3LlamaForCausalLM
WEIGHT_SCALE = 0.02  # the random linears, at transformers' init scale
INTERMEDIATE_FACTOR = 2  # the head's MLP width over its hidden width (small: it adds nothing, see above)


def aux_layer_ids(num_layers: int) -> list[int]:
    """Three target layers, distinct and ascending (vLLM collects each once, in layer order), the last the residual
    stream after the last layer (vLLM's aux id i is the input of layer i, so `num_layers` is the output of the
    last)."""
    if num_layers < 2:
        raise ValueError(f"a target of {num_layers} layer(s) has no three distinct hidden states to give a head")
    return [0, num_layers // 2, num_layers]


def write_head(pack_dir: str | Path, dest: str | Path, seed: int = 0) -> Path:
    """A random bf16 EAGLE-3 head for the pack at `pack_dir` (its hidden width, heads, vocabulary), written to
    `dest` (config.json and model.safetensors), in the layout and with the pass-through the module docstring
    describes."""
    from safetensors import safe_open
    from safetensors.torch import save_file

    pack = Pack.open(pack_dir)
    c = pack.text_config
    h, n = int(c["hidden_size"]), int(c["num_hidden_layers"])
    heads = int(c["num_attention_heads"])
    kv = int(c.get("num_key_value_heads") or heads)
    hd = int(c.get("head_dim") or h // heads)
    inter = INTERMEDIATE_FACTOR * h
    g = torch.Generator().manual_seed(seed)

    def rand(out: int, fan_in: int) -> torch.Tensor:
        return (torch.randn(out, fan_in, generator=g) * WEIGHT_SCALE).bfloat16()

    norm_name = next((name for name in pack.tensors if name.endswith("model.norm.weight")
                      or name == "model.language_model.norm.weight"), None)
    if norm_name is None:
        raise ValueError(f"{pack_dir}: no final norm (model.norm.weight) to give the head")
    record = pack.tensors[norm_name]
    with safe_open(str(record.file), "pt") as f:
        final_norm = f.get_tensor(norm_name).float()

    fc = torch.zeros(h, 3 * h)
    fc[:, 2 * h:] = torch.eye(h)  # the third auxiliary state: the target's last residual stream, passed through
    tensors = {
        "fc.weight": fc.bfloat16(),
        "norm.weight": final_norm.bfloat16(),
        "midlayer.hidden_norm.weight": torch.ones(h, dtype=torch.bfloat16),
        "midlayer.input_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        "midlayer.post_attention_layernorm.weight": torch.ones(h, dtype=torch.bfloat16),
        "midlayer.self_attn.q_proj.weight": rand(heads * hd, 2 * h),
        "midlayer.self_attn.k_proj.weight": rand(kv * hd, 2 * h),
        "midlayer.self_attn.v_proj.weight": rand(kv * hd, 2 * h),
        "midlayer.self_attn.o_proj.weight": torch.zeros(h, heads * hd, dtype=torch.bfloat16),
        "midlayer.mlp.gate_proj.weight": rand(inter, h),
        "midlayer.mlp.up_proj.weight": rand(inter, h),
        "midlayer.mlp.down_proj.weight": torch.zeros(h, inter, dtype=torch.bfloat16),
    }
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    save_file(tensors, str(dest / "model.safetensors"), metadata={"format": "pt"})
    config = {
        "architectures": [ARCHITECTURE],
        "model_type": "llama",
        "hidden_size": h,
        "target_hidden_size": h,
        "intermediate_size": inter,
        "num_hidden_layers": 1,
        "num_attention_heads": heads,
        "num_key_value_heads": kv,
        "head_dim": hd,
        "hidden_act": "silu",
        "rms_norm_eps": float(c.get("rms_norm_eps") or 1e-6),
        "vocab_size": int(c["vocab_size"]),
        "draft_vocab_size": int(c["vocab_size"]),
        "max_position_embeddings": int(c.get("max_position_embeddings") or 4096),
        "rope_theta": float(c.get("rope_theta") or (c.get("rope_parameters") or {}).get("rope_theta") or 10000.0),
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        # top level: the one place every vLLM model runner reads them (format/eagle_head.py aux_layer_id_readings)
        "eagle_aux_hidden_state_layer_ids": aux_layer_ids(n),
        "eagle_config": {"use_aux_hidden_state": True},
    }
    (dest / "config.json").write_text(json.dumps(config, indent=2))
    return dest
