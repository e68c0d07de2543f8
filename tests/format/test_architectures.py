"""The architecture tables (format/families/) against real checkpoints: a tiny model of each architecture, saved by
transformers and rewritten into the layout ExLlamaV3's converter writes (dev/family_oracle.py: gpt-oss's fused experts
split, Qwen3.5 under model.language_model), holds exactly the tensors its table expects (every linear plain), whatever
the config's switches; and one tensor less or one more is named."""

from __future__ import annotations

import json

import pytest

transformers = pytest.importorskip("transformers")
torch = pytest.importorskip("torch")

from vllm_exl3.dev import family_oracle  # noqa: E402
from vllm_exl3.format.families import ARCHITECTURES  # noqa: E402
from vllm_exl3.format.pack import Pack  # noqa: E402

SMALL = dict(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=8)
MOE = dict(moe_intermediate_size=16, num_experts_per_tok=2)
CASES = {
    "Qwen3MoeForCausalLM": [("Qwen3MoeConfig", dict(MOE, num_experts=4)),
                            ("Qwen3MoeConfig", dict(MOE, num_experts=4, mlp_only_layers=[1], attention_bias=True)),
                            ("Qwen3MoeConfig", dict(MOE, num_experts=4, decoder_sparse_step=2,
                                                    tie_word_embeddings=True))],
    "Glm4MoeForCausalLM": [("Glm4MoeConfig", dict(MOE, n_routed_experts=4, first_k_dense_replace=1,
                                                  n_shared_experts=1)),
                           ("Glm4MoeConfig", dict(MOE, n_routed_experts=4, first_k_dense_replace=2, n_shared_experts=1,
                                                  use_qk_norm=True, attention_bias=True))],
    "LlamaForCausalLM": [("LlamaConfig", {}), ("LlamaConfig", dict(attention_bias=True, mlp_bias=True,
                                                                   tie_word_embeddings=True))],
    "MistralForCausalLM": [("MistralConfig", {})],
    "Qwen2ForCausalLM": [("Qwen2Config", {}), ("Qwen2Config", dict(tie_word_embeddings=True))],
    "Qwen3ForCausalLM": [("Qwen3Config", {}), ("Qwen3Config", dict(attention_bias=True))],
}
# The families the second oracle builds (dev/family_oracle.SOURCES), at a small geometry and with a config switch.
TINY = family_oracle.Geometry(hidden=32, heads=4, kv_heads=2, head_dim=8, layers=3, experts=4, top_k=2, moe_inter=16,
                              inter=64, vocab=64)
ORACLE_CASES = {
    "MixtralForCausalLM": [{}],
    "MiniMaxM2ForCausalLM": [{}],
    "Ernie4_5_MoeForCausalLM": [{}, dict(moe_layer_start_index=0, moe_num_shared_experts=0)],
    "GptOssForCausalLM": [{}],
    "Glm4MoeLiteForCausalLM": [{}, dict(q_lora_rank=None)],
    "Qwen3NextForCausalLM": [{}, dict(mlp_only_layers=[0])],
    "Qwen3_5MoeForCausalLM": [{}],
}


def _oracle_checkpoint(arch: str, switches: dict, root, seed: int) -> None:
    """transformers' checkpoint of `arch` (with `switches` on its config), rewritten into ExLlamaV3's layout."""
    from safetensors.torch import load_file, save_file

    cls_name, kwargs, released = family_oracle.SOURCES[arch]
    torch.manual_seed(seed)
    config = getattr(transformers, cls_name)(**{**kwargs(TINY), **switches})
    config.architectures = [arch]
    transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root)
    tensors = family_oracle.to_exl3_layout(arch, load_file(root / "model.safetensors"))
    save_file({k: v.contiguous() for k, v in tensors.items()}, root / "model.safetensors")
    saved = json.loads((root / "config.json").read_text())
    (root / "config.json").write_text(json.dumps({**saved, **released, **switches}))


def test_every_table_is_tested():
    assert set(CASES) | set(ORACLE_CASES) | {"Qwen3_5MoeForConditionalGeneration"} == set(ARCHITECTURES)
    assert ARCHITECTURES["Qwen3_5MoeForConditionalGeneration"] is ARCHITECTURES["Qwen3_5MoeForCausalLM"]


@pytest.fixture(scope="module")
def saved(tmp_path_factory):
    """architecture -> [model directories transformers wrote], made once."""
    out = {}
    for arch, cases in CASES.items():
        for i, (config_class, extra) in enumerate(cases):
            config = getattr(transformers, config_class)(**SMALL, **extra)
            assert config.architectures == [arch] or config.architectures is None
            config.architectures = [arch]
            root = tmp_path_factory.mktemp(f"{arch}-{i}")
            torch.manual_seed(0)
            transformers.AutoModelForCausalLM.from_config(config).save_pretrained(root)
            out.setdefault(arch, []).append(root)
    for arch, cases in ORACLE_CASES.items():
        for i, switches in enumerate(cases):
            root = tmp_path_factory.mktemp(f"{arch}-{i}")
            _oracle_checkpoint(arch, switches, root, seed=i)
            out.setdefault(arch, []).append(root)
    return out


@pytest.mark.parametrize("arch", sorted({**CASES, **ORACLE_CASES}))
def test_a_transformers_checkpoint_is_complete(saved, arch):
    for root in saved[arch]:
        pack = Pack.open(root)
        assert pack.problems() == [], f"{root}: {[str(p) for p in pack.problems()]}"
        assert pack.notes == [f"complete for {arch} " + pack.notes[0].split(" ", 3)[3]], pack.notes


@pytest.mark.parametrize("arch", sorted({**CASES, **ORACLE_CASES}))
def test_one_tensor_less_or_more_is_named(saved, arch, tmp_path):
    from safetensors.torch import load_file, save_file

    root = saved[arch][-1]
    tensors = load_file(root / "model.safetensors")
    layers = ARCHITECTURES[arch].layers
    for module in dict.fromkeys((sorted(tensors)[len(tensors) // 2].rpartition(".")[0],
                                 f"{layers}.1.post_attention_layernorm",
                                 "lm_head" if "lm_head.weight" in tensors else "model.norm")):
        pack_root = tmp_path / module
        pack_root.mkdir()
        (pack_root / "config.json").write_bytes((root / "config.json").read_bytes())
        save_file({k: v for k, v in tensors.items() if k.rpartition(".")[0] != module}, pack_root / "model.safetensors")
        problems = Pack.open(pack_root).problems()
        assert problems and all(module in p.tensor for p in problems), [str(p) for p in problems]
    pack_root = tmp_path / "extra"
    pack_root.mkdir()
    (pack_root / "config.json").write_bytes((root / "config.json").read_bytes())
    save_file({**tensors, f"{layers}.0.mlp.lora_A.weight": torch.zeros(2)}, pack_root / "model.safetensors")
    [problem] = Pack.open(pack_root).problems()
    assert problem.tensor == f"{layers}.0.mlp.lora_A.weight" and "does not have" in str(problem)
