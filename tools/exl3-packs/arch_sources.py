"""Tiny randomly initialised bf16 models of the MoE families beyond Qwen3-MoE and GLM-4.5 (transformers 5.17), as
sources for ExLlamaV3's converter (families.py). families.py runs it on the GPU machine
(transformers 5.17 there). 'a' geometry = fixtures for the project, 'b' = held out (other dims, more experts)."""
import json, os, shutil, sys, zlib

import torch
import transformers as T

sys.path.insert(0, os.path.dirname(__file__))
import source_dir  # noqa: E402

OUT = sys.argv[1] if len(sys.argv) > 1 else ".gold/src"
TOK = sys.argv[2] if len(sys.argv) > 2 else ".gold/tok"
COMMON = dict(vocab_size=2048, max_position_embeddings=1024, tie_word_embeddings=False, bos_token_id=0, eos_token_id=2,
              pad_token_id=0)


def geo(v):
    # a: 128-multiples, 8 experts top-2; b: held-out dims, 16 experts top-4
    return (dict(h=256, heads=4, kv=2, hd=64, moe=128, ff=512, E=8, k=2, L=3) if v == "a" else
            dict(h=384, heads=6, kv=2, hd=64, moe=192, ff=768, E=16, k=4, L=4))


def build(fam, v):
    g = geo(v)
    att = dict(hidden_size=g["h"], num_attention_heads=g["heads"], num_key_value_heads=g["kv"], head_dim=g["hd"],
               num_hidden_layers=g["L"], rms_norm_eps=1e-6)
    if fam == "mixtral":
        cfg = T.MixtralConfig(**COMMON, **att, intermediate_size=g["moe"], num_local_experts=g["E"],
                              num_experts_per_tok=g["k"])
        return T.MixtralForCausalLM(cfg)
    if fam == "minimaxm2":
        cfg = T.MiniMaxM2Config(**COMMON, **att, intermediate_size=g["moe"], num_local_experts=g["E"],
                                num_experts_per_tok=g["k"])
        cfg.rotary_dim, cfg.scoring_func = g["hd"], "sigmoid"  # released MiniMax-M2 configs carry both; vLLM reads them
        return T.MiniMaxM2ForCausalLM(cfg)
    if fam == "ernie45moe":
        att.pop("head_dim")
        cfg = T.Ernie4_5_MoeConfig(**COMMON, **att, intermediate_size=g["ff"], moe_intermediate_size=g["moe"],
                                   moe_num_experts=g["E"], moe_k=g["k"], moe_num_shared_experts=1,
                                   moe_layer_start_index=1, moe_layer_interval=1, use_bias=False)
        return T.Ernie4_5_MoeForCausalLM(cfg)
    if fam in ("qwen3next", "qwen35moe"):
        att["num_hidden_layers"] = L = max(g["L"], 4)  # ExLlamaV3 puts full attention on every 4th layer
        lt = ["linear_attention"] * (L - 1) + ["full_attention"]
        kw = dict(**COMMON, **att, layer_types=lt, linear_conv_kernel_dim=4, linear_key_head_dim=64,
                  linear_value_head_dim=64, linear_num_key_heads=2, linear_num_value_heads=4,
                  moe_intermediate_size=g["moe"], shared_expert_intermediate_size=g["moe"], num_experts=g["E"],
                  num_experts_per_tok=g["k"])
        if fam == "qwen3next":
            cfg = T.Qwen3NextConfig(intermediate_size=g["ff"], decoder_sparse_step=1, norm_topk_prob=True, **kw)
            return T.Qwen3NextForCausalLM(cfg)
        if v == "a":  # text only: ExLlamaV3 reads Qwen3_5MoeForCausalLM as model.language_model.* (save() renames)
            cfg = T.Qwen3_5MoeTextConfig(**kw)
            return T.Qwen3_5MoeForCausalLM(cfg)
        # 'b': the layout Qwen3.5/3.6 MoE packs are downloaded in: the conditional-generation class with a (tiny)
        # vision tower; its special token ids moved inside the 2048-token vocabulary
        vis = dict(depth=2, hidden_size=128, intermediate_size=256, num_heads=2, out_hidden_size=g["h"],
                   num_position_embeddings=64, patch_size=16, spatial_merge_size=2, temporal_patch_size=2,
                   deepstack_visual_indexes=[])  # ExLlamaV3 reads it with no default
        text = dict(kw)
        for k in COMMON:
            if k not in ("vocab_size", "max_position_embeddings", "pad_token_id", "bos_token_id", "eos_token_id"):
                text.pop(k, None)
        cfg = T.Qwen3_5MoeConfig(text_config=text, vision_config=vis, image_token_id=2044, video_token_id=2045,
                                 vision_start_token_id=2046, vision_end_token_id=2047,
                                 tie_word_embeddings=False)
        return T.Qwen3_5MoeForConditionalGeneration(cfg)
    if fam == "gptoss":
        lt = ["sliding_attention", "full_attention"] * (g["L"] // 2) + ["sliding_attention"] * (g["L"] % 2)
        # released gpt-oss: rms_norm_eps 1e-5 (vLLM's GptOss uses it whatever the config says) and a context that
        # makes YaRN's factor 32 = max_position_embeddings / original_max_position_embeddings (ExLlamaV3 uses the
        # ratio, vLLM and transformers the factor: they agree only when both say the same)
        cfg = T.GptOssConfig(**dict(COMMON, max_position_embeddings=131072), **dict(att, rms_norm_eps=1e-5),
                             intermediate_size=g["moe"], num_local_experts=g["E"], num_experts_per_tok=g["k"],
                             sliding_window=128, layer_types=lt)
        return T.GptOssForCausalLM(cfg)
    if fam == "glm4moelite":
        att.pop("head_dim")
        cfg = T.Glm4MoeLiteConfig(**COMMON, **att, intermediate_size=g["ff"], moe_intermediate_size=g["moe"],
                                  n_routed_experts=g["E"], n_shared_experts=1, num_experts_per_tok=g["k"],
                                  kv_lora_rank=128, q_lora_rank=192, qk_nope_head_dim=64, qk_rope_head_dim=32,
                                  v_head_dim=64, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                                  norm_topk_prob=True, mlp_layer_types=["dense"] + ["sparse"] * (g["L"] - 1))
        return T.Glm4MoeLiteForCausalLM(cfg)
    raise ValueError(fam)


FAMILIES = ["mixtral", "minimaxm2", "ernie45moe", "qwen3next", "qwen35moe", "gptoss", "glm4moelite"]

if __name__ == "__main__":
    only = sys.argv[3].split(",") if len(sys.argv) > 3 else FAMILIES
    for fam in only:
        for v in ("a", "b"):
            name = f"{fam}-{v}"
            d = os.path.join(OUT, name + "-bf16")
            torch.manual_seed(zlib.crc32(name.encode()))
            try:
                m = build(fam, v)
            except Exception as e:
                print("FAIL", name, type(e).__name__, e); continue
            with torch.no_grad():  # router biases get some signal, as in the GLM fixtures
                for n, p in list(m.named_parameters()) + list(m.named_buffers()):
                    if n.endswith(("e_score_correction_bias", "router.bias", "_bias")) or ".bias" in n and "expert" in n:
                        p.copy_(torch.randn_like(p) * 0.1)
                    elif n.endswith("mlp.gate.weight") and not p.abs().max():  # ERNIE's router starts at zero: every
                        p.normal_(0, 0.02)  # expert would tie and only a tie-break would pick
            m = m.to(torch.bfloat16)
            shutil.rmtree(d, ignore_errors=True)
            m.save_pretrained(d, safe_serialization=True)
            if type(m).__name__ == "Qwen3_5MoeForCausalLM":  # ExLlamaV3 1.6.5 reads it as model.language_model.*
                from safetensors.torch import load_file, save_file
                for f in [f for f in os.listdir(d) if f.endswith(".safetensors")]:
                    t = load_file(os.path.join(d, f))
                    save_file({("model.language_model." + k[6:] if k.startswith("model.") else k): v
                               for k, v in t.items()}, os.path.join(d, f), metadata={"format": "pt"})
                idx = os.path.join(d, "model.safetensors.index.json")
                if os.path.exists(idx):
                    j = json.load(open(idx))
                    j["weight_map"] = {("model.language_model." + k[6:] if k.startswith("model.") else k): v
                                       for k, v in j["weight_map"].items()}
                    json.dump(j, open(idx, "w"), indent=2)
            source_dir.finish(d, TOK)
            n = sum(p.numel() for p in m.parameters())
            print("ok", name, n, sorted({k.split(".")[-2] + "." + k.split(".")[-1] for k in m.state_dict() if ".layers.1." in k})[:40])
