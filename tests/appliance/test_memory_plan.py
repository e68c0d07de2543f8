"""The unified-memory plan, from the fixture packs' real configs and byte counts and from fake memory figures.

Spark-sized cases scale the weights to a large MoE's size (the fixtures are tiny) but keep the plan's own
arithmetic, so each expected figure below is worked out by hand next to its assertion.
"""

from __future__ import annotations

from dataclasses import replace

import pytest

from support.fixtures import pack_dir
from vllm_exl3 import demo
from vllm_exl3.format.pack import Pack
from vllm_exl3.appliance.memory_plan import GIB, MemoryFigures, ModelShape, PlanSettings, Request, model_max_len, plan
from vllm_exl3.appliance.preflight import model_shape

# What a DGX Spark reports: ~119.7 GiB of 128 GB visible to the OS.
SPARK_TOTAL = int(119.7 * GIB)
NO_SLACK = PlanSettings(max_gpu_memory_utilization=0.9, headroom_gib=0, runtime_overhead_gib=0, cuda_graph_gib=0,
                        min_context=1)


def spark(free_gib: float, available_gib: float | None = None) -> MemoryFigures:
    return MemoryFigures(SPARK_TOTAL, int(free_gib * GIB), int((available_gib or free_gib) * GIB))


def test_meminfo_parsing(tmp_path):
    f = tmp_path / "meminfo"
    f.write_text("MemTotal:       125515892 kB\nMemFree:        98765432 kB\nMemAvailable:   110000000 kB\n"
                 "Cached:          9000000 kB\n")
    m = MemoryFigures.from_meminfo(f)
    assert (m.total, m.free, m.available) == (125515892 * 1024, 98765432 * 1024, 110000000 * 1024)
    assert m.reclaimable == (110000000 - 98765432) * 1024
    f.write_text("MemTotal: 1 kB\n")
    with pytest.raises(ValueError, match="MemFree, MemAvailable"):
        MemoryFigures.from_meminfo(f)


def test_kv_per_token_from_fixture_configs():
    qwen = model_shape(Pack.open(demo.PACK))  # 2 layers, 2 KV heads of 64, bf16
    assert qwen.kv_bytes_per_token(tp=1) == 2 * 2 * 2 * 64 * 2 == 1024
    assert qwen.kv_bytes_per_token(tp=2) == 512  # KV heads split across the two Sparks
    assert qwen.kv_bytes_per_token(tp=1, kv_dtype="fp8") == 512
    assert qwen.kv_bytes_per_token(tp=4) == 512  # fewer heads than ranks: replicated, not split further
    glm = model_shape(Pack.open(pack_dir("glm4moe-a-exl3-mcg-b4")))  # 3 layers; the MTP layer holds no KV
    assert glm.kv_bytes_per_token(tp=1) == 3 * 2 * 2 * 64 * 2
    with pytest.raises(ValueError, match="unknown --kv-cache-dtype"):
        glm.kv_bytes_per_token(tp=1, kv_dtype="int3")


def test_mtp_drafts_add_the_mtp_layers_weights_as_stored_and_their_kv(tmp_path):
    """vLLM's `mtp` drafter loads the pack's MTP layers (the target alone skips them): their tensors count, as
    stored, only then, and so does the KV of their attention (one layer of the trunk's shape each)."""
    from vllm_exl3.appliance.preflight import memory_plan
    from vllm_exl3.dev import mtp

    root = mtp.add_mtp_layer(pack_dir("..") / "exl3-families" / "qwen35moe-a-exl3-mul1-b3.5", tmp_path / "pack")
    pack = Pack.open(root)
    stored = sum(r.nbytes for n, r in pack.tensors.items() if n.startswith("mtp."))
    assert pack.mtp_storage() == (1, stored)
    plain, drafting = model_shape(pack), model_shape(pack, mtp=True)
    assert drafting.weight_bytes == plain.weight_bytes + stored == sum(r.nbytes for r in pack.tensors.values())
    assert plain.kv_bytes_per_token(tp=1) == 4 * 2 * 2 * 64 * 2  # 4 layers, 2 KV heads of 64, bf16
    assert drafting.kv_bytes_per_token(tp=1) == 5 * 2 * 2 * 64 * 2  # and the MTP layer's attention
    mtp_config = {"method": "mtp", "num_speculative_tokens": 1}
    for config, shape in ((None, plain), ({"method": "ngram"}, plain), (mtp_config, drafting),
                          ({**mtp_config, "method": "qwen3_5_mtp"}, drafting)):
        p = memory_plan(pack, Request(), NO_SLACK, spark(100), config)
        assert p.weights_bytes == shape.weight_bytes, config
        assert any(line.startswith("mtp drafts: 1 MTP layer(s)") for line in p.lines) == (shape is drafting)
    glm = model_shape(Pack.open(pack_dir("glm4moe-a-exl3-mcg-b4")), mtp=True)  # stores no MTP layer: nothing added
    assert glm.mtp_layers == 0 and glm.kv_bytes_per_token(tp=1) == 3 * 2 * 2 * 64 * 2
    glm = Pack.open(mtp.add_mtp_layer(pack_dir("glm4moe-a-exl3-mcg-b4"), tmp_path / "glm"))  # GLM's: layer 3
    assert glm.mtp_storage() == (1, sum(r.nbytes for n, r in glm.tensors.items() if n.startswith("model.layers.3.")))
    assert model_shape(glm, mtp=True).kv_bytes_per_token(tp=1) == 4 * 2 * 2 * 64 * 2


def test_eagle3_drafts_add_the_heads_weights_as_stored_and_its_layers_kv(tmp_path):
    """vLLM's `eagle3` drafter loads a separate head beside the target: its safetensors bytes count, and so does the
    KV of its decoder layer (the head's own KV heads and head size, here the demo pack's geometry that
    dev/eagle3.py copies); without the drafter, or with another method, neither."""
    import json

    from vllm_exl3.appliance.preflight import memory_plan
    from vllm_exl3.dev import eagle3

    pack = Pack.open(demo.PACK)
    head = eagle3.write_head(demo.PACK, tmp_path / "head")
    stored = (head / "model.safetensors").stat().st_size
    header = 8 + int.from_bytes((head / "model.safetensors").read_bytes()[:8], "little")
    h = 256  # hidden; heads 4 x 64, 2 KV heads, MLP 2 x hidden; fc 3h -> h; four norms of h; all bf16
    assert stored - header == 2 * (h * 3 * h + 4 * h + 256 * 2 * h + 2 * 128 * 2 * h + h * 256
                                   + 2 * 512 * h + h * 512)
    plain = model_shape(pack)
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": 2}
    for spec, extra_weights, kv in ((None, 0, 1024), ({"method": "ngram"}, 0, 1024),
                                    (config, stored - header, 1024 + 1 * 2 * 2 * 64 * 2),
                                    ({**config, "method": "eagle"}, stored - header, 1024 + 512)):
        p = memory_plan(pack, Request(), NO_SLACK, spark(100), spec)
        assert p.weights_bytes == plain.weight_bytes + extra_weights, spec
        assert any(line == f"KV {kv / 1024:.1f} KiB per token (auto)" for line in p.lines), (spec, p.lines)
        assert any(line.startswith("draft head: 1 layer(s)") for line in p.lines) == bool(extra_weights), p.lines
    # A head of other dims: its own KV heads and head size, split over TP like the target's.
    json_path = head / "config.json"
    json_path.write_text(json.dumps({**json.loads(json_path.read_text()), "num_key_value_heads": 8,
                                     "head_dim": 128, "num_hidden_layers": 2}))
    p = memory_plan(pack, Request(tp=2), NO_SLACK, spark(100), config)
    assert any(line == f"KV {(512 + 2 * 2 * 4 * 128 * 2) / 1024:.1f} KiB per token (auto)" for line in p.lines)


def test_kv_per_token_mla():
    shape = ModelShape.from_config({"num_hidden_layers": 61, "hidden_size": 7168, "num_attention_heads": 128,
                                    "kv_lora_rank": 512, "qk_rope_head_dim": 64, "vocab_size": 129280}, 0)
    assert shape.kv_bytes_per_token(tp=2) == 61 * (512 + 64) * 2  # one latent per token, on every rank


def test_weights_come_from_the_pack():
    pack = Pack.open(demo.PACK)
    shape = model_shape(pack)
    assert shape.weight_bytes == sum(r.nbytes for r in pack.tensors.values())  # every tensor, nothing else
    assert shape.largest_linear_bytes == 2 * 2048 * 256  # the bf16 lm_head, 2048 x 256 (padded geometry)


def test_fixture_pack_on_an_idle_spark_gets_the_cap_and_the_models_context():
    p = plan(spark(115), model_shape(Pack.open(demo.PACK)), Request(max_model_len=65536), PlanSettings())
    assert p.fits and p.gpu_memory_utilization == 0.88  # (115 - 6) / 119.7 = 0.91, above the preset's cap
    assert p.max_model_len == 1024  # the model's max_position_embeddings


def test_budget_is_mem_available_minus_the_host_reserve_and_kv_is_handed_over_exactly():
    """20 GiB free but 60 GiB available (40 GiB page cache): vLLM 0.32 counts MemAvailable as free on an
    integrated GPU, so the plan does too; the KV cache gets exactly what is left, in whole blocks."""
    shape = model_shape(Pack.open(demo.PACK))
    settings = PlanSettings()  # 6 GiB reserve, 3 GiB overhead, 1 GiB CUDA graphs
    p = plan(spark(20, 60), shape, Request(max_model_len=1024), settings)
    assert p.fits and p.gpu_memory_utilization == 0.45  # floor((60 - 6) / 119.7, 2)
    budget = int(0.45 * SPARK_TOTAL)
    fixed = (shape.weight_bytes + shape.activation_bytes(1, 2048, 256) + shape.moe_workspace_bytes(1, 2048)
             + 4 * GIB)
    per_token = shape.kv_bytes_per_token(1)
    assert p.kv_cache_memory_bytes == (budget - fixed) // per_token // 16 * 16 * per_token
    assert p.kv_cache_memory_bytes % (16 * per_token) == 0 and budget - fixed - p.kv_cache_memory_bytes < 16 * per_token
    assert p.flags()["kv-cache-memory-bytes"] == p.kv_cache_memory_bytes
    eager = plan(spark(20, 60), shape, Request(max_model_len=1024, enforce_eager=True), settings)
    assert eager.kv_cache_memory_bytes - p.kv_cache_memory_bytes == pytest.approx(GIB, abs=16 * per_token)
    reserve = plan(spark(20, 60), shape, Request(max_model_len=1024), replace(settings, headroom_gib=30))
    assert reserve.gpu_memory_utilization == 0.25  # floor((60 - 30) / 119.7, 2)


def test_explicit_kv_bytes_are_checked():
    shape = large_moe(40)
    ok = plan(spark(100), shape, Request(kv_cache_memory_bytes=8 * GIB), NO_SLACK)
    assert ok.fits and ok.kv_cache_memory_bytes == 8 * GIB // 1536 // 16 * 16 * 1536
    too_big = plan(spark(100), shape, Request(kv_cache_memory_bytes=80 * GIB), NO_SLACK)
    assert not too_big.fits and "--kv-cache-memory-bytes 85899345920 (80.0 GiB) does not fit" in too_big.problems[0]


def test_utilization_follows_free_memory():
    shape = model_shape(Pack.open(demo.PACK))
    p = plan(spark(60), shape, Request(max_model_len=1024), PlanSettings())
    assert p.fits and p.gpu_memory_utilization == 0.45  # floor((60 - 6) / 119.7, 2)
    assert p.gpu_memory_utilization * SPARK_TOTAL <= 60 * GIB  # vLLM's start check: u * total <= free


def large_moe(weight_gib: float) -> ModelShape:
    """The GLM fixture's config scaled to a large MoE's weight bytes (KV per token: 3*2*2*64*2 = 1536 B)."""
    return replace(model_shape(Pack.open(pack_dir("glm4moe-a-exl3-mcg-b4"))),
                   weight_bytes=int(weight_gib * GIB), max_position_embeddings=131072)


def test_context_is_capped_by_kv_memory():
    # 100 GiB free, no headroom/overhead: u = 0.83 -> 99.35 GiB; weights 90 GiB -> ~9.35 GiB KV = ~6.5M tokens
    # at 1536 B/token, far above 131072: the context is the model's. With 99 GiB of weights it is KV-bound.
    p = plan(spark(100), large_moe(90), Request(max_model_len=131072), NO_SLACK)
    assert p.fits and p.max_model_len == 131072
    tight = plan(spark(100), large_moe(99.3), Request(max_model_len=131072), NO_SLACK)
    kv = int(0.83 * SPARK_TOTAL) - int(99.3 * GIB) - tight_activations()
    assert tight.fits and tight.max_model_len == (kv // 1536 // 16 * 16) // 256 * 256 < 131072


def tight_activations() -> int:
    shape, req = large_moe(0), Request()
    return (shape.activation_bytes(1, req.max_num_batched_tokens, req.max_num_seqs)
            + shape.moe_workspace_bytes(1, req.max_num_batched_tokens))


def test_too_big_for_one_spark_is_refused_with_advice_and_fits_on_two():
    settings = PlanSettings()  # 0.88 cap, 6 GiB headroom, 4 GiB runtime overhead
    one = plan(spark(112, 118), large_moe(110), Request(max_model_len=131072), settings)
    assert not one.fits
    assert "exceed" in one.problems[0]
    assert not any("drop_caches" in a for a in one.advice)  # page cache already counts as available
    assert any("headroom-gib (the 6.0 GiB host reserve)" in a for a in one.advice)
    assert any("two Sparks" in a for a in one.advice)
    assert not any("fp8" in a for a in one.advice)  # weights alone do not fit: KV settings would not help
    two = plan(spark(112), large_moe(110), Request(tp=2, max_model_len=131072), settings)
    assert two.fits and two.max_model_len == 131072  # 55 GiB per node


def test_explicit_values_are_checked_not_replaced():
    shape = large_moe(40)
    too_much = plan(spark(50), shape, Request(gpu_memory_utilization=0.9), NO_SLACK)
    assert not too_much.fits and "vLLM refuses at start" in too_much.problems[0]  # 0.9 * 119.7 > 50
    assert "lower --gpu-memory-utilization to 0.41 or less" in too_much.advice[0]  # floor(50 / 119.7, 2)
    pinned = plan(spark(50), shape, Request(max_model_len=10_000_000, max_model_len_pinned=True), NO_SLACK)
    assert not pinned.fits and "--max-model-len 10000000" in pinned.problems[0]
    assert any("lower --max-model-len" in a for a in pinned.advice)
    assert any("--kv-cache-dtype fp8" in a for a in pinned.advice)


def test_below_the_minimum_context_is_refused():
    settings = PlanSettings(max_gpu_memory_utilization=0.9, headroom_gib=0, runtime_overhead_gib=0,
                            cuda_graph_gib=0, min_context=100_000)
    p = plan(spark(100), large_moe(99.3), Request(max_model_len=131072), settings)
    assert not p.fits and "below the preset's minimum of 100000" in p.problems[0]


def test_plan_settings_from_preset_table():
    s = PlanSettings.from_table({"max-gpu-memory-utilization": 0.8, "min-context": 2048})
    assert s.max_gpu_memory_utilization == 0.8 and s.min_context == 2048 and s.headroom_gib == 6.0
    with pytest.raises(ValueError, match="unknown \\[memory\\] key"):
        PlanSettings.from_table({"headroom": 1})


def test_model_max_len_as_vllm_derives_it():
    assert model_max_len({"max_position_embeddings": 40960}) == 40960
    assert model_max_len({"max_position_embeddings": 40960, "seq_length": 8192}) == 8192  # the smallest key
    linear = {"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": 4.0}}
    assert model_max_len(linear) == 16384
    yarn = {"max_position_embeddings": 131072, "rope_parameters": {"rope_type": "yarn", "factor": 4.0}}
    assert model_max_len(yarn) == 131072  # YaRN configs already carry the scaled length
    assert model_max_len({"max_position_embeddings": 40960}, {"model_max_length": 32768}) == 32768
    assert model_max_len({}) is None
    assert model_shape(Pack.open(demo.PACK)).max_position_embeddings == 1024


def test_moe_workspace_counts_the_native_backends_shared_buffer():
    """Qwen3-30B-A3B on one node at the full 1024-token step: 8192 (token, k) pairs, I = 768, H = 2048; each fp16
    input three times (plain + duplicated fragment order, csrc/moe_workspace_layout)."""
    shape = ModelShape.from_config({"num_hidden_layers": 48, "num_attention_heads": 32, "num_key_value_heads": 4,
                                    "head_dim": 128, "hidden_size": 2048, "vocab_size": 151936,
                                    "moe_intermediate_size": 768, "num_experts_per_tok": 8}, weight_bytes=1)
    pairs = 8192
    expected = pairs * 2 * 768 * 4 + max(3 * pairs * 2 * 2048 * 2, 3 * pairs * 768 * 2 + pairs * 2048 * 4)
    assert shape.moe_workspace_bytes(1, 4096) == expected  # capped at the op's 1024-token chunk
    assert shape.moe_workspace_bytes(1, 512) == expected // 2
    # TP 2 halves the intermediate slice (384, already a multiple of 128); dense models hold none
    assert shape.moe_workspace_bytes(2, 1024) == pairs * 2 * 384 * 4 + max(3 * pairs * 2 * 2048 * 2,
                                                                           3 * pairs * 384 * 2 + pairs * 2048 * 4)
    dense = ModelShape.from_config({"num_hidden_layers": 2, "hidden_size": 256, "num_attention_heads": 4}, 1)
    assert dense.moe_workspace_bytes(1, 1024) == 0


@pytest.mark.parametrize("text, tok", [
    ({"max_position_embeddings": 4096, "rope_scaling": {"rope_type": "linear", "factor": float("inf")}}, None),
    ({"max_position_embeddings": 4096}, {"model_max_length": float("nan")}),
    ({"max_position_embeddings": 4096, "max_sequence_length": float("inf")}, {"model_max_length": 1e400}),
    ({"max_position_embeddings": 4096, "seq_length": True}, {"model_max_length": -1}),
])
def test_non_finite_lengths_in_a_config_are_skipped_not_a_crash(text, tok):
    assert model_max_len(text, tok) == 4096
