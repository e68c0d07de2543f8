"""Pack reading: real fixture packs, generated multi-file packs, and one real broken file per failure mode."""

from __future__ import annotations

import json
import pytest
import torch

from vllm_exl3.format.errors import Exl3FormatError
from vllm_exl3.format.headers import read_safetensors_header
from vllm_exl3.format.pack import Pack, verify_pack
from vllm_exl3.format.tensors import load_weights
from vllm_exl3.dev.synthetic import linear_tensors, random_weights, write_pack

from support.fixtures import pack_dir


def test_fixture_packs_read_per_tensor_bits_and_codebook(fixture_pack):
    pack = Pack.open(fixture_pack)
    pack.check_markers()
    meta = json.loads((fixture_pack / "golden" / "meta.json").read_text())["tensors"]
    linears = pack.linears()
    for name, m in meta.items():
        lin = linears[name]
        assert lin.bits == m["bits"] and lin.codebook == m["codebook"], name
        assert list(lin.trellis.shape) == m["trellis_shape"]
        assert (lin.in_padded, lin.out_padded) == (m["in_features"], m["out_features"])
    assert "model.embed_tokens.weight" in pack.unquantized()
    assert pack.quantization_config["quant_method"] == "exl3"


def test_half_integer_pack_is_mul1():
    lins = Pack.open(pack_dir("qwen3moe-a-exl3-mul1-b2.5")).linears()
    assert {lin.bits for lin in lins.values()} == {2.5, 6.0}
    assert lins["model.layers.0.self_attn.q_proj"].trellis.shape[-1] == 40


def test_listing_reads_headers_only(tmp_path, monkeypatch):
    """Streaming: opening a pack never reads tensor data, checking it reads only the 4-byte markers, and `verify`
    adds the suh/svh scales (finiteness), never a trellis."""
    import vllm_exl3.format.records as F  # the marker and scale checks read through records.read_bytes

    reads = []
    real = F.read_bytes
    monkeypatch.setattr(F, "read_bytes", lambda rec: reads.append(rec) or real(rec))
    pack = Pack.open(pack_dir("qwen3moe-a-exl3-mcg-b3"))
    assert not reads
    pack.check()
    assert reads and all(r.nbytes == 4 for r in reads)
    reads.clear()
    pack, problems = verify_pack(pack_dir("qwen3moe-a-exl3-mcg-b3"))
    assert not problems and pack.linears()
    assert {r.name.rsplit(".", 1)[1] for r in reads} == {"mcg", "suh", "svh"}


def _linear_pack(tmp_path, **overrides):
    """A one-linear pack (mcg, 3 bits) whose tensors can be replaced or removed to break it."""
    w = random_weights(256, 128, 3, "mcg", seed=1)
    tensors = linear_tensors("model.layers.0.mlp.down_proj", w)
    tensors["model.embed_tokens.weight"] = torch.randn(16, 256).bfloat16()
    for k, v in overrides.items():
        key = f"model.layers.0.mlp.down_proj.{k}"
        if v is None:
            tensors.pop(key)
        else:
            tensors[key] = v
    return write_pack(tmp_path / "pack", tensors)


def test_synthetic_pack_round_trips(tmp_path):
    root = _linear_pack(tmp_path)
    pack, problems = verify_pack(root)
    assert not problems
    lin = pack.linears()["model.layers.0.mlp.down_proj"]
    assert (lin.bits, lin.codebook, lin.in_padded, lin.out_padded) == (3.0, "mcg", 256, 128)


MARKER_MUL1 = torch.tensor(0x83DCD12D - (1 << 32), dtype=torch.int32)

BROKEN = {
    "missing companion (no suh)": ({"suh": None}, "model.layers.0.mlp.down_proj.suh", "missing companion"),
    "missing companion (no svh)": ({"svh": None}, "model.layers.0.mlp.down_proj.svh", "missing companion"),
    "missing companion (no trellis)": ({"trellis": None}, "model.layers.0.mlp.down_proj.trellis",
                                       "missing companion"),
    "both markers": ({"mul1": MARKER_MUL1}, "model.layers.0.mlp.down_proj.mul1", "both .mcg and .mul1"),
    "unknown marker value": ({"mcg": torch.tensor(12345, dtype=torch.int32)}, "model.layers.0.mlp.down_proj.mcg",
                             "unknown marker value 0x00003039"),
    "trellis last dim": ({"trellis": torch.zeros(16, 8, 36, dtype=torch.int16).random_()},
                         "model.layers.0.mlp.down_proj.trellis", "found 36"),
    "suh length": ({"suh": torch.ones(384).half()}, "model.layers.0.mlp.down_proj.suh", "expected shape [256]"),
    "svh length": ({"svh": torch.ones(64).half()}, "model.layers.0.mlp.down_proj.svh", "expected shape [128]"),
    "half-integer without mul1": ({"trellis": torch.zeros(16, 8, 40, dtype=torch.int16).random_()},
                                  "model.layers.0.mlp.down_proj.trellis", "half-integer bits only with the mul1"),
    "row-codec embedding": ({"trellis": torch.zeros(16, 40, dtype=torch.int16)}, "model.layers.0.mlp.down_proj.trellis",
                            "row codec for quantized embeddings"),
    "trellis dtype": ({"trellis": torch.zeros(16, 8, 48, dtype=torch.int32)}, "model.layers.0.mlp.down_proj.trellis",
                      "expected dtype I16"),
}


@pytest.mark.parametrize("case", sorted(BROKEN))
def test_broken_linear_fails_naming_file_tensor_and_expectation(tmp_path, case):
    overrides, tensor, phrase = BROKEN[case]
    root = _linear_pack(tmp_path, **overrides)
    with pytest.raises(Exl3FormatError) as info:
        pack = Pack.open(root)
        pack.linears()
        pack.check_markers()
    e = info.value
    assert e.tensor == tensor and "model.safetensors" in str(e) and phrase in str(e), str(e)
    pack, problems = verify_pack(root)  # verify reports the same problem rather than raising
    assert any(tensor in str(p) for p in problems)


def test_truncated_file_names_the_tensor_past_eof(tmp_path):
    root = _linear_pack(tmp_path)
    f = root / "model.safetensors"
    data = f.read_bytes()
    f.write_bytes(data[:-100])
    with pytest.raises(Exl3FormatError) as info:
        read_safetensors_header(f)
    assert "past end-of-file" in str(info.value) and info.value.tensor and str(f) in str(info.value)


def test_truncated_header(tmp_path):
    root = _linear_pack(tmp_path)
    f = root / "model.safetensors"
    f.write_bytes(f.read_bytes()[:40])
    with pytest.raises(Exl3FormatError, match="header length"):
        Pack.open(root)


def test_corrupt_header(tmp_path):
    root = _linear_pack(tmp_path)
    f = root / "model.safetensors"
    data = bytearray(f.read_bytes())
    data[8:20] = b"\x00garbage!!!!"
    f.write_bytes(bytes(data))
    with pytest.raises(Exl3FormatError, match="corrupt header"):
        Pack.open(root)


def test_header_offsets_that_disagree_with_shape(tmp_path):
    root = _linear_pack(tmp_path)
    f = root / "model.safetensors"
    data = f.read_bytes()
    n = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + n])
    name = "model.layers.0.mlp.down_proj.suh"
    header[name]["shape"] = [255]
    raw = json.dumps(header, separators=(",", ":")).encode()
    assert len(raw) <= n
    f.write_bytes(data[:8] + raw.ljust(n) + data[8 + n:])
    with pytest.raises(Exl3FormatError) as info:
        Pack.open(root)
    assert info.value.tensor == name and "data_offsets" in str(info.value)


def _sharded(tmp_path):
    tensors = {}
    for i in range(4):
        tensors.update(linear_tensors(f"model.layers.{i}.self_attn.q_proj", random_weights(256, 256, 4, "mul1", i)))
    return write_pack(tmp_path / "sharded", tensors, shards=3)


def test_multi_file_pack_with_index(tmp_path):
    root = _sharded(tmp_path)
    pack, problems = verify_pack(root)
    assert not problems and len(pack.files) == 3 and len(pack.linears()) == 4


def test_multi_file_pack_without_index(tmp_path):
    root = _sharded(tmp_path)
    (root / "model.safetensors.index.json").unlink()
    assert len(Pack.open(root).linears()) == 4


def test_index_naming_a_missing_file(tmp_path):
    root = _sharded(tmp_path)
    (root / "model-00002-of-00003.safetensors").unlink()
    with pytest.raises(Exl3FormatError) as info:
        Pack.open(root)
    assert "model-00002-of-00003.safetensors" in str(info.value) and "missing file" in str(info.value)
    assert "model.safetensors.index.json" in str(info.value)


def test_index_that_omits_a_file_is_a_verify_failure(tmp_path):
    """vLLM loads only the files an index names: an omitted shard's tensors would silently vanish."""
    root = _sharded(tmp_path)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    index["weight_map"] = {k: v for k, v in index["weight_map"].items() if v != "model-00003-of-00003.safetensors"}
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    _, problems = verify_pack(root)
    assert any("model-00003-of-00003.safetensors" in str(p) and "omits" in str(p) for p in problems)


def test_index_placing_a_tensor_in_the_wrong_file(tmp_path):
    root = _sharded(tmp_path)
    index = json.loads((root / "model.safetensors.index.json").read_text())
    name = next(iter(index["weight_map"]))
    index["weight_map"][name] = "model-00003-of-00003.safetensors" if index["weight_map"][name] != \
        "model-00003-of-00003.safetensors" else "model-00001-of-00003.safetensors"
    (root / "model.safetensors.index.json").write_text(json.dumps(index))
    with pytest.raises(Exl3FormatError) as info:
        Pack.open(root)
    assert info.value.tensor == name


def test_legacy_sign_bitfields(tmp_path):
    """Pre-v0.0.2 packs store ±1 signs as bitfields: bit i of word w set => element 16w+i is -1."""
    w = random_weights(128, 128, 2, "3inst", seed=2)
    su = torch.tensor([0b1] + [0] * 7, dtype=torch.int16)  # element 0 negative
    sv = torch.tensor([-1] + [0] * 7, dtype=torch.int16)  # elements 0..15 negative
    tensors = {"layer.trellis": w.trellis, "layer.su": su, "layer.sv": sv}
    lin = Pack.open(write_pack(tmp_path / "legacy", tensors)).linears()["layer"]
    loaded = load_weights(lin)
    assert loaded.suh.tolist() == [-1.0] + [1.0] * 127
    assert loaded.svh.tolist() == [-1.0] * 16 + [1.0] * 112


def test_missing_config(tmp_path):
    root = _linear_pack(tmp_path)
    (root / "config.json").unlink()
    with pytest.raises(Exl3FormatError, match="config.json.*missing file"):
        Pack.open(root)


def test_verify_flags_non_exl3_config(tmp_path):
    root = _linear_pack(tmp_path)
    cfg = json.loads((root / "config.json").read_text())
    cfg["quantization_config"]["quant_method"] = "gptq"
    (root / "config.json").write_text(json.dumps(cfg))
    _, problems = verify_pack(root)
    assert any("quant_method 'exl3'" in str(p) for p in problems)


def test_logical_features_undo_padding(tmp_path):
    tensors = linear_tensors("model.layers.0.mlp.down_proj", random_weights(320, 200, 4, "mcg", 0))
    root = write_pack(tmp_path / "p", tensors, config={"hidden_size": 200, "intermediate_size": 320})
    pack = Pack.open(root)
    assert pack.logical_features(pack.linears()["model.layers.0.mlp.down_proj"]) == (320, 200)


def test_logical_features_of_gated_delta_net_projections(tmp_path):
    """Qwen3-Next geometry (qwen3next-b): the linear attention's out_proj reads value_dim = 4 x 64 = 256, which a
    192-wide MoE intermediate also pads to; the GDN widths are model dimensions, so 256 stands."""
    tensors = {**linear_tensors("model.layers.0.linear_attn.out_proj", random_weights(256, 384, 3, "mcg", 0)),
               **linear_tensors("model.layers.0.mlp.experts.0.down_proj", random_weights(192, 384, 3, "mcg", 1))}
    root = write_pack(tmp_path / "p", tensors, config={
        "hidden_size": 384, "moe_intermediate_size": 192, "shared_expert_intermediate_size": 192,
        "linear_num_key_heads": 2, "linear_key_head_dim": 64, "linear_num_value_heads": 4, "linear_value_head_dim": 64})
    pack = Pack.open(root)
    assert pack.logical_features(pack.linears()["model.layers.0.linear_attn.out_proj"]) == (256, 384)
    assert pack.logical_features(pack.linears()["model.layers.0.mlp.experts.0.down_proj"]) == (192, 384)



def test_serve_time_index_refuses_what_verify_refuses(tmp_path):
    """`index_model` (what vLLM's config hook reads) applies the same checks: a codebook the config contradicts,
    a duplicate key in config.json."""
    import json
    import shutil

    from vllm_exl3.format.index import index_model

    def copy():
        root = tmp_path / f"p{len(list(tmp_path.iterdir()))}"
        shutil.copytree(pack_dir("qwen3moe-a-exl3-mcg-b3"), root, ignore=shutil.ignore_patterns("golden"))
        return root

    index_model(str(copy()))  # the control
    root = copy()
    cfg = json.loads((root / "config.json").read_text())
    cfg["quantization_config"]["codebook"] = "mul1"
    (root / "config.json").write_text(json.dumps(cfg))
    with pytest.raises(Exl3FormatError, match="mul1 codebook that quantization_config.codebook"):
        index_model(str(root))
    root = copy()
    (root / "config.json").write_text('{"model_type": "a", ' + (root / "config.json").read_text().lstrip()[1:])
    with pytest.raises(Exl3FormatError, match="repeated keys"):
        index_model(str(root))
