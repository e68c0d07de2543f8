"""Full-size EXL3 packs with random trellis, shaped like real MoE models, for the serving benchmarks on the GPU.

Every tensor is what ExLlamaV3's converter writes for that model (names, dtypes, padded shapes; routed experts,
attention and the head as EXL3 linears, the head at 6 bits as `head_bits` says, the router and norms plain), so
the pack loads in the plugin and in ExLlamaV3 alike; only the values are random (any 16-bit trellis state decodes,
dev/synthetic.py), so the text is meaningless and only speed is measured on it. A WordLevel tokenizer with one
token per id covers the whole vocabulary, so vLLM and ExLlamaV3 can detokenize whatever the model emits.

    python3 bench/gpu/packs.py OUT --shape qwen3-30b-a3b --bits 4 [--layers N] [--codebook mcg]
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import torch

from vllm_exl3.dev.synthetic import linear_tensors, random_weights
from vllm_exl3.format.constants import TILE
from vllm_exl3.format.tensors import Exl3Weights

HEAD_BITS = 6  # ExLlamaV3's default head_bits (its converter's -hb)
SHARD_BYTES = 2 * 10**9


@dataclass(frozen=True)
class Shape:
    """The parts of a model's config.json that set the tensors' shapes (values from the published configs)."""

    architecture: str
    model_type: str
    hidden: int
    layers: int
    heads: int
    kv_heads: int
    head_dim: int
    experts: int
    top_k: int
    moe_intermediate: int
    vocab: int
    dense_intermediate: int
    dense_layers: int = 0  # leading dense-MLP layers (GLM's first_k_dense_replace)
    shared_experts: int = 0
    qk_norm: bool = False
    attention_bias: bool = False
    extra_config: tuple[tuple[str, object], ...] = ()
    # Hybrid models (Qwen3-Next): every `full_attention_interval`-th layer is (gated: q_proj twice as wide)
    # attention, the others a gated delta net of these dims; 0: attention in every layer.
    full_attention_interval: int = 0
    attn_output_gate: bool = False
    linear_heads: tuple[int, int] = (0, 0)  # linear_num_key_heads, linear_num_value_heads
    linear_head_dims: tuple[int, int] = (0, 0)  # linear_key_head_dim, linear_value_head_dim
    linear_conv_kernel: int = 4
    shared_expert_intermediate: int = 0  # Qwen's one shared expert (`mlp.shared_expert`) behind a sigmoid gate

    def full_attention(self, layer: int) -> bool:
        return not self.full_attention_interval or (layer + 1) % self.full_attention_interval == 0


SHAPES = {
    "qwen3-30b-a3b": Shape("Qwen3MoeForCausalLM", "qwen3_moe", 2048, 48, 32, 4, 128, 128, 8, 768, 151936, 6144,
                           qk_norm=True,
                           extra_config=(("decoder_sparse_step", 1), ("mlp_only_layers", []), ("rope_theta", 1e6),
                                         ("max_position_embeddings", 40960), ("rms_norm_eps", 1e-6))),
    "glm-4.5-air": Shape("Glm4MoeForCausalLM", "glm4_moe", 4096, 46, 96, 8, 128, 128, 8, 1408, 151552, 10944,
                         dense_layers=1, shared_experts=1, attention_bias=True,
                         extra_config=(("first_k_dense_replace", 1), ("n_group", 1), ("topk_group", 1),
                                       ("routed_scaling_factor", 1.0), ("partial_rotary_factor", 0.5),
                                       ("use_qk_norm", False), ("num_nextn_predict_layers", 0),
                                       ("rope_theta", 1e6), ("max_position_embeddings", 131072),
                                       ("rms_norm_eps", 1e-5))),
    "qwen3-next-80b-a3b": Shape("Qwen3NextForCausalLM", "qwen3_next", 2048, 48, 16, 2, 256, 512, 10, 512, 151936,
                                5120, qk_norm=True, full_attention_interval=4, attn_output_gate=True,
                                linear_heads=(16, 32), linear_head_dims=(128, 128), shared_expert_intermediate=512,
                                extra_config=(("decoder_sparse_step", 1), ("mlp_only_layers", []),
                                              ("partial_rotary_factor", 0.25), ("rope_theta", 1e7),
                                              ("max_position_embeddings", 262144), ("rms_norm_eps", 1e-6))),
}


def layer_tensors(shape: Shape, layer: int, bits: float, codebook: str) -> dict[str, torch.Tensor]:
    g = torch.Generator().manual_seed(1000 + layer)
    p = f"model.layers.{layer}"
    out: dict[str, torch.Tensor] = {}
    h = shape.hidden
    if shape.full_attention(layer):
        out.update(attention_tensors(shape, p, layer, bits, codebook, g))
    else:
        out.update(delta_net_tensors(shape, p, layer, bits, codebook, g))
    for n in ("input_layernorm", "post_attention_layernorm"):
        out[f"{p}.{n}.weight"] = torch.ones(h, dtype=torch.bfloat16)
    if layer < shape.dense_layers:
        for name, (k, n) in (("gate_proj", (h, shape.dense_intermediate)), ("up_proj", (h, shape.dense_intermediate)),
                             ("down_proj", (shape.dense_intermediate, h))):
            out.update(linear_tensors(f"{p}.mlp.{name}", random_weights(k, n, bits, codebook, seed=layer * 8 + 5)))
        return out
    out[f"{p}.mlp.gate.weight"] = (torch.randn(shape.experts, h, generator=g) * 0.02).half()
    if shape.architecture.startswith("Glm4Moe"):
        out[f"{p}.mlp.gate.e_score_correction_bias"] = torch.zeros(shape.experts, dtype=torch.float32)
    # One random draw per layer for all routed experts (a pack of tens of GB in about a minute), split per expert.
    words, i = round(bits * TILE), shape.moe_intermediate
    trellis = torch.randint(-2**15, 2**15, (shape.experts, 3, h // TILE, i // TILE, words), dtype=torch.int16,
                            generator=g)
    up = random_weights(h, i, bits, codebook, seed=layer)
    down = random_weights(i, h, bits, codebook, seed=layer + 7)
    for e in range(shape.experts):
        for j, name in enumerate(("gate_proj", "up_proj", "down_proj")):
            t, src = trellis[e, j].clone(), (up if name != "down_proj" else down)
            if name == "down_proj":
                t = t.reshape(i // TILE, h // TILE, words)
            w = Exl3Weights(t, src.suh.clone(), src.svh.clone(), codebook, float(bits))
            out.update(linear_tensors(f"{p}.mlp.experts.{e}.{name}", w))
    shared = [("shared_experts", shape.moe_intermediate * shape.shared_experts)] if shape.shared_experts else []
    if shape.shared_expert_intermediate:
        shared.append(("shared_expert", shape.shared_expert_intermediate))
        out[f"{p}.mlp.shared_expert_gate.weight"] = (torch.randn(1, h, generator=g) * 0.02).half()
    for module, n_shared in shared:
        for name, (k, n) in (("gate_proj", (h, n_shared)), ("up_proj", (h, n_shared)), ("down_proj", (n_shared, h))):
            out.update(linear_tensors(f"{p}.mlp.{module}.{name}",
                                      random_weights(k, n, bits, codebook, seed=layer * 8 + 6)))
    return out


def attention_tensors(shape: Shape, p: str, layer: int, bits: float, codebook: str,
                      g: torch.Generator) -> dict[str, torch.Tensor]:
    """An attention layer's q/k/v/o as EXL3 linears (q twice as wide with an output gate), biases and q/k norms
    where the shape has them."""
    h, q_out, kv_out = shape.hidden, shape.heads * shape.head_dim, shape.kv_heads * shape.head_dim
    out: dict[str, torch.Tensor] = {}
    for name, (k, n) in (("q_proj", (h, q_out * (2 if shape.attn_output_gate else 1))), ("k_proj", (h, kv_out)),
                         ("v_proj", (h, kv_out)), ("o_proj", (q_out, h))):
        w = random_weights(k, n, bits, codebook, seed=layer * 8 + len(out))
        if shape.attention_bias and name != "o_proj":
            w = Exl3Weights(w.trellis, w.suh, w.svh, w.codebook, w.bits, torch.randn(n, generator=g).half() * 0.02)
        out.update(linear_tensors(f"{p}.self_attn.{name}", w))
    if shape.qk_norm:
        for n in ("q_norm", "k_norm"):
            out[f"{p}.self_attn.{n}.weight"] = torch.ones(shape.head_dim, dtype=torch.bfloat16)
    return out


def delta_net_tensors(shape: Shape, p: str, layer: int, bits: float, codebook: str,
                      g: torch.Generator) -> dict[str, torch.Tensor]:
    """A gated delta net layer's tensors as ExLlamaV3 stores Qwen3-Next's: `in_proj_qkvz` and `out_proj` EXL3,
    `in_proj_ba` 16-bit (format/families/qwen3_next.py; dev/family_oracle.py KEPT_PLAIN), the conv, decay and norm
    plain."""
    (nk, nv), (dk, dv) = shape.linear_heads, shape.linear_head_dims
    key_dim, value_dim, h = nk * dk, nv * dv, shape.hidden
    out: dict[str, torch.Tensor] = {}
    for name, (k, n) in (("in_proj_qkvz", (h, 2 * key_dim + 2 * value_dim)), ("out_proj", (value_dim, h))):
        out.update(linear_tensors(f"{p}.linear_attn.{name}", random_weights(k, n, bits, codebook,
                                                                            seed=layer * 8 + len(out))))
    out[f"{p}.linear_attn.in_proj_ba.weight"] = (torch.randn(2 * nv, h, generator=g) * 0.02).half()
    out[f"{p}.linear_attn.conv1d.weight"] = (torch.randn(2 * key_dim + value_dim, 1, shape.linear_conv_kernel,
                                                         generator=g) * 0.1).bfloat16()
    out[f"{p}.linear_attn.A_log"] = torch.log(torch.rand(nv, generator=g) * 15 + 1).bfloat16()
    out[f"{p}.linear_attn.dt_bias"] = torch.ones(nv, dtype=torch.bfloat16)
    out[f"{p}.linear_attn.norm.weight"] = torch.ones(dv, dtype=torch.bfloat16)
    return out


def tokenizer_files(vocab: int) -> dict[str, str]:
    """A WordLevel tokenizer with one token per id ("t0" ... ), whitespace-split: every id the model can emit
    detokenizes, and prompts tokenize (unknown words to t0)."""
    model = {"type": "WordLevel", "vocab": {f"t{i}": i for i in range(vocab)}, "unk_token": "t0"}
    tok = {"version": "1.0", "truncation": None, "padding": None, "added_tokens": [],
           "normalizer": None, "pre_tokenizer": {"type": "WhitespaceSplit"}, "post_processor": None,
           "decoder": {"type": "WordPiece", "prefix": "##", "cleanup": False}, "model": model}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "bos_token": "t1", "eos_token": "t2", "unk_token": "t0",
              "model_max_length": 1 << 20}
    return {"tokenizer.json": json.dumps(tok), "tokenizer_config.json": json.dumps(config)}


def config_json(shape: Shape, layers: int, bits: float, codebook: str) -> dict:
    c = {"architectures": [shape.architecture], "model_type": shape.model_type, "hidden_size": shape.hidden,
         "intermediate_size": shape.dense_intermediate, "moe_intermediate_size": shape.moe_intermediate,
         "num_hidden_layers": layers, "num_attention_heads": shape.heads, "num_key_value_heads": shape.kv_heads,
         "head_dim": shape.head_dim, "vocab_size": shape.vocab, "num_experts_per_tok": shape.top_k,
         "norm_topk_prob": True, "hidden_act": "silu", "tie_word_embeddings": False, "torch_dtype": "bfloat16",
         "attention_bias": shape.attention_bias, "bos_token_id": 1, "eos_token_id": 2,
         **dict(shape.extra_config)}
    if shape.model_type == "glm4_moe":
        c.update(n_routed_experts=shape.experts, n_shared_experts=shape.shared_experts)
    else:
        c.update(num_experts=shape.experts)
    if shape.full_attention_interval:
        (nk, nv), (dk, dv) = shape.linear_heads, shape.linear_head_dims
        c.update(full_attention_interval=shape.full_attention_interval,
                 layer_types=["full_attention" if shape.full_attention(i) else "linear_attention"
                              for i in range(layers)],
                 linear_num_key_heads=nk, linear_num_value_heads=nv, linear_key_head_dim=dk,
                 linear_value_head_dim=dv, linear_conv_kernel_dim=shape.linear_conv_kernel)
    if shape.shared_expert_intermediate:
        c["shared_expert_intermediate_size"] = shape.shared_expert_intermediate
    c["quantization_config"] = {"quant_method": "exl3", "version": "vllm-exl3 bench/gpu/packs.py (random trellis)",
                                "bits": float(bits), "head_bits": HEAD_BITS,
                                "calibration": {"rows": 0, "cols": 0}, "out_scales": "auto", "codebook": codebook}
    return c


def outer_tensors(shape: Shape, codebook: str) -> dict[str, torch.Tensor]:
    """The tensors outside the layers: embedding, final norm, the EXL3 head."""
    g = torch.Generator().manual_seed(1)
    head = random_weights(shape.hidden, shape.vocab, HEAD_BITS, codebook, seed=99)
    return {"model.embed_tokens.weight": (torch.randn(shape.vocab, shape.hidden, generator=g) * 0.02).bfloat16(),
            "model.norm.weight": torch.ones(shape.hidden, dtype=torch.bfloat16),
            **linear_tensors("lm_head", head)}


def _write_shard(out: Path, name: str, shape_name: str, layers: list[int], bits: float, codebook: str,
                 with_outer: bool) -> tuple[str, list[str], int]:
    """One shard file: the given layers (and the outer tensors if asked); runs in a worker process."""
    from safetensors.torch import save_file

    shape = SHAPES[shape_name]
    tensors = outer_tensors(shape, codebook) if with_outer else {}
    for layer in layers:
        tensors.update(layer_tensors(shape, layer, bits, codebook))
    save_file({k: v.contiguous() for k, v in tensors.items()}, str(out / name), metadata={"format": "pt"})
    return name, sorted(tensors), sum(v.nbytes for v in tensors.values())


def write(out: Path, shape_name: str, bits: float, layers: int | None = None, codebook: str = "mcg",
          workers: int = 8) -> dict:
    """The pack, its shards written side by side by `workers` processes (one random draw per layer is the slow
    part: one process writes a 16 GB pack in minutes)."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    shape = SHAPES[shape_name]
    layers = layers or shape.layers
    t0 = time.time()
    out.mkdir(parents=True, exist_ok=True)
    per_layer = sum(t.nbytes for t in layer_tensors(shape, shape.dense_layers, bits, codebook).values())
    per_shard = max(1, int(SHARD_BYTES // per_layer))
    groups = [list(range(i, min(layers, i + per_shard))) for i in range(0, layers, per_shard)]
    names = [f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors" for i in range(len(groups))]
    weight_map: dict[str, str] = {}
    total = 0
    # spawned, not forked: a fork of a process whose torch thread pool has run can hang in the child's first op
    spawn = mp.get_context("spawn")
    with ProcessPoolExecutor(max_workers=max(1, min(workers, len(groups))), mp_context=spawn) as pool:
        jobs = [pool.submit(_write_shard, out, name, shape_name, group, bits, codebook, i == 0)
                for i, (name, group) in enumerate(zip(names, groups))]
        for job in jobs:
            name, keys, nbytes = job.result()
            weight_map.update({k: name for k in keys})
            total += nbytes
    (out / "model.safetensors.index.json").write_text(json.dumps({"metadata": {"total_size": total},
                                                                  "weight_map": weight_map}))
    (out / "config.json").write_text(json.dumps(config_json(shape, layers, bits, codebook), indent=1))
    for name, text in tokenizer_files(shape.vocab).items():
        (out / name).write_text(text)
    return {"pack": str(out), "shape": shape_name, "layers": layers, "of_layers": shape.layers, "bits": bits,
            "codebook": codebook, "bytes": total, "shards": len(names), "seconds": round(time.time() - t0, 1)}


def main(argv: list[str]) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("out", type=Path)
    ap.add_argument("--shape", choices=sorted(SHAPES), required=True)
    ap.add_argument("--bits", type=float, default=4.0)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the model has (disk, time)")
    ap.add_argument("--codebook", default="mcg", choices=("mcg", "mul1", "3inst"))
    a = ap.parse_args(argv)
    print(json.dumps(write(a.out, a.shape, a.bits, a.layers, a.codebook)), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
