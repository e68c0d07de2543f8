"""The plugin's vLLM layers built in-process (real vLLM classes, CPU), loaded through their own weight loaders
exactly as vLLM's model loader calls them, against the torch reference.

Tensor parallelism is simulated rank by rank: vLLM's layers read the rank and world size from
`get_tensor_model_parallel_rank/_world_size` in `vllm.model_executor.layers.linear`, which we set per rank; the
per-rank outputs must concatenate (column splits) or sum (row splits) to the single-rank result, including
splits that fall inside a 128-block.

Over 400 lines on purpose: every test builds real vLLM layers through the same per-rank fixtures and loader calls
(`rank`, `make_config`, `load`); the kernels behind them are tested in tests/kernels/.
"""

from __future__ import annotations

import re
import tempfile

import pytest
import torch

vllm = pytest.importorskip("vllm")

import vllm_exl3  # noqa: E402
from vllm_exl3.format import reference as R  # noqa: E402
from vllm_exl3.format.errors import Exl3FormatError# noqa: E402
from vllm_exl3.format.tensors import Exl3Weights
from vllm_exl3.dev.synthetic import linear_tensors, random_weights, write_pack  # noqa: E402

vllm_exl3.register()

from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import init_distributed_environment, initialize_model_parallel  # noqa: E402
from vllm.model_executor.layers import linear as vllm_linear  # noqa: E402
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead  # noqa: E402

from vllm_exl3.integration.config import Exl3Config, Exl3ConfigError  # noqa: E402
from vllm_exl3.kernels import ops  # noqa: E402
from vllm_exl3.kernels.interface import SideBySideLinearGroup  # noqa: E402
from vllm_exl3.kernels.backends.torch_ref import TorchLinearGroup  # noqa: E402

from support.fixtures import pack_dir  # noqa: E402


@pytest.fixture(scope="module", autouse=True)
def vllm_context():
    mc = ModelConfig(model=str(pack_dir("qwen3moe-a-exl3-mul1-b4")), dtype="float32")
    with set_current_vllm_config(VllmConfig(model_config=mc)):
        init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                     distributed_init_method=f"file://{tempfile.mktemp()}")
        initialize_model_parallel(1, 1)
        yield


@pytest.fixture
def rank(monkeypatch):
    """rank(r, n): make vLLM's layers believe they are tensor-parallel rank r of n."""

    def set_rank(r: int, n: int):
        monkeypatch.setattr(vllm_linear, "get_tensor_model_parallel_rank", lambda: r)
        monkeypatch.setattr(vllm_linear, "get_tensor_model_parallel_world_size", lambda: n)

    return set_rank


def make_config(tmp_path, linears: dict[str, Exl3Weights], plain: dict[str, torch.Tensor] | None = None,
                raw: dict | None = None, packed: dict | None = None) -> tuple[Exl3Config, dict[str, torch.Tensor]]:
    tensors = {}
    for prefix, w in linears.items():
        tensors.update(linear_tensors(prefix, w))
    tensors.update(plain or {})
    root = write_pack(tmp_path / "pack", tensors)
    cfg = Exl3Config({"quant_method": "exl3", **(raw or {})})
    cfg.maybe_update_config(str(root))
    cfg.packed_modules_mapping = dict(packed or {})
    return cfg, tensors


def load(layer, tensors: dict[str, torch.Tensor], shards: dict[str, object] | None = None) -> None:
    """Hand every checkpoint tensor of the layer to its parameter's loader, as vLLM's loaders do."""
    shards = shards or {layer.prefix: None}
    for ckpt_prefix, shard_id in shards.items():
        for name, t in tensors.items():
            if name.rpartition(".")[0] != ckpt_prefix:
                continue
            param = getattr(layer, name.rpartition(".")[2])
            if shard_id is None:
                param.weight_loader(param, t)
            else:
                param.weight_loader(param, t, shard_id)
    layer.quant_method.process_weights_after_loading(layer)


def reference(x: torch.Tensor, w: Exl3Weights, in_features: int, out_features: int) -> torch.Tensor:
    return x.double() @ R.full_weight(w).double()[:in_features, :out_features]


def rel(a, b) -> float:
    return ((a.double() - b.double()).norm() / b.double().norm()).item()


# ---------------------------------------------------------------------------------------------------------------
@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_column_parallel_splits_concatenate(tmp_path, rank, tp):
    """out 384 = 3 blocks: tp 2 and 4 split blocks (halo), tp 3 is aligned."""
    w = random_weights(256, 384, 3, "mcg", seed=1)
    cfg, tensors = make_config(tmp_path, {"l.up": w})
    x = torch.randn(5, 256)
    outs = []
    for r in range(tp):
        rank(r, tp)
        layer = vllm_linear.ColumnParallelLinear(256, 384, bias=False, quant_config=cfg, prefix="l.up",
                                                 return_bias=False)
        load(layer, tensors)
        outs.append(layer(x))
    assert rel(torch.cat(outs, -1), reference(x, w, 256, 384)) < 1e-5


@pytest.mark.parametrize("tp", [1, 2, 3, 4])
def test_row_parallel_splits_sum(tmp_path, rank, tp):
    w = random_weights(384, 256, 4, "mul1", seed=2)
    cfg, tensors = make_config(tmp_path, {"l.down": w})
    x = torch.randn(5, 384)
    total = 0
    for r in range(tp):
        rank(r, tp)
        layer = vllm_linear.RowParallelLinear(384, 256, bias=False, quant_config=cfg, prefix="l.down",
                                              reduce_results=False, return_bias=False)
        load(layer, tensors)
        k = 384 // tp
        total = total + layer(x[:, r * k:(r + 1) * k])
    assert rel(total, reference(x, w, 384, 256)) < 1e-5


def test_padded_geometry_zero_extends_input(tmp_path, rank):
    """Logical 320 -> 200 stored as 384 x 256: the padded input rows of W are not zero."""
    rank(0, 1)
    w = random_weights(320, 200, 2.5, "mul1", seed=3)
    cfg, tensors = make_config(tmp_path, {"l.proj": w})
    layer = vllm_linear.ReplicatedLinear(320, 200, bias=False, quant_config=cfg, prefix="l.proj", return_bias=False)
    load(layer, tensors)
    x = torch.randn(3, 320)
    assert rel(layer(x), reference(x, w, 320, 200)) < 1e-5


@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_shards_keep_their_own_scales(tmp_path, rank, tp):
    """q/k/v with different bits and codebooks; at tp=2 each rank has one 64-wide K/V head (mid-block)."""
    ws = {"a.q_proj": random_weights(256, 256, 4, "mul1", 4), "a.k_proj": random_weights(256, 128, 3, "mcg", 5),
          "a.v_proj": random_weights(256, 128, 2, "3inst", 6)}
    cfg, tensors = make_config(tmp_path, ws, packed={"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    x = torch.randn(4, 256)
    per_rank = []
    for r in range(tp):
        rank(r, tp)
        layer = vllm_linear.QKVParallelLinear(256, 64, 4, 2, bias=False, quant_config=cfg, prefix="a.qkv_proj",
                                              return_bias=False)
        load(layer, tensors, {"a.q_proj": "q", "a.k_proj": "k", "a.v_proj": "v"})
        per_rank.append(layer(x).split([256 // tp, 128 // tp, 128 // tp], -1))
    for i, (name, n) in enumerate([("a.q_proj", 256), ("a.k_proj", 128), ("a.v_proj", 128)]):
        got = torch.cat([p[i] for p in per_rank], -1)
        assert rel(got, reference(x, ws[name], 256, n)) < 1e-5, name


def _qkv_layer(tmp_path, rank, ws: dict[str, Exl3Weights], tp: int = 1, r: int = 0):
    cfg, tensors = make_config(tmp_path, ws, packed={"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    rank(r, tp)
    layer = vllm_linear.QKVParallelLinear(256, 64, 4, 2, bias=False, quant_config=cfg, prefix="a.qkv_proj",
                                          return_bias=False)
    load(layer, tensors, {"a.q_proj": "q", "a.k_proj": "k", "a.v_proj": "v"})
    return layer


def _qkv_weights(bits=(3, 3, 3), codebooks=("mcg", "mcg", "mcg")) -> dict[str, Exl3Weights]:
    return {f"a.{n}_proj": random_weights(256, out, b, cb, seed)
            for n, out, b, cb, seed in zip("qkv", (256, 128, 128), bits, codebooks, (7, 8, 9))}


def _outputs_are_the_shards(layer, ws, x) -> None:
    for got, (name, w) in zip(layer(x).split([256, 128, 128], -1), ws.items()):
        assert rel(got, reference(x, w, 256, w.out_padded)) < 1e-5, name


@pytest.mark.parametrize("setting", [None, "0"])
def test_whole_alike_shards_run_as_one_grouped_call(tmp_path, rank, monkeypatch, setting):
    """q/k/v of one codebook and width, unsliced: one `linear_group` call serves all three, the backend's grouped
    binding (the torch reference's here; the native one on a GPU), or with VLLM_EXL3_GROUP_LINEARS=0 the shards' own
    calls side by side in that op; the output is the same."""
    from vllm_exl3.kernels import selection
    if setting is not None:
        monkeypatch.setenv(selection.GROUP_ENV, setting)
    ws = _qkv_weights()
    layer = _qkv_layer(tmp_path, rank, ws)
    group = layer.quant_method.group
    assert layer.exl3_group == 512
    assert type(group) is (SideBySideLinearGroup if setting == "0" else TorchLinearGroup)
    assert all(g is s for g, s in zip(group.shards, (layer.quant_method.bound[i] for i in range(3)), strict=True))
    # made from the shards' own bindings: no second decoded copy of their weights (the torch reference's Ŵ)
    assert ops.serving(layer.exl3_trellis_0, "linear_group") is group
    assert ops.serving(layer.exl3_trellis_0) is layer.quant_method.bound[0]  # its own binding stays served
    _outputs_are_the_shards(layer, ws, torch.randn(4, 256))


@pytest.mark.parametrize("tp", [2, 4])
def test_aligned_head_slices_are_grouped_on_every_rank(tmp_path, rank, tp):
    """Two Sparks (tp 2) on 128-wide heads: each rank's q, k and v slices are whole 128-blocks of the stored
    linears, so every rank runs them as one grouped call; the ranks' outputs side by side are the model's."""
    heads = 4
    ws = {f"a.{n}_proj": random_weights(256, heads * 128, 3, "mcg", seed) for n, seed in zip("qkv", (11, 12, 13))}
    cfg, tensors = make_config(tmp_path, ws, packed={"qkv_proj": ["q_proj", "k_proj", "v_proj"]})
    x = torch.randn(3, 256)
    per_rank = []
    for r in range(tp):
        rank(r, tp)
        layer = vllm_linear.QKVParallelLinear(256, 128, heads, heads, bias=False, quant_config=cfg,
                                              prefix="a.qkv_proj", return_bias=False)
        load(layer, tensors, {"a.q_proj": "q", "a.k_proj": "k", "a.v_proj": "v"})
        assert layer.quant_method.group is not None and layer.exl3_group == 3 * heads * 128 // tp
        per_rank.append(layer(x).split([heads * 128 // tp] * 3, -1))
    for i, (name, w) in enumerate(ws.items()):
        assert rel(torch.cat([p[i] for p in per_rank], -1), reference(x, w, 256, heads * 128)) < 1e-5, name


@pytest.mark.parametrize("case", ["mixed widths", "mixed codebooks"])
def test_shards_that_differ_run_side_by_side_in_one_op(tmp_path, rank, case):
    """Shards of other widths or codebooks have no grouped kernel: their own calls, side by side in one
    `linear_group` op (no cat for the model's graph to split: kernels/interface.py SideBySideLinearGroup)."""
    ws = _qkv_weights(bits=(4, 3, 3)) if case == "mixed widths" else _qkv_weights(codebooks=("mcg", "mul1", "mcg"))
    layer = _qkv_layer(tmp_path, rank, ws)
    assert type(layer.quant_method.group) is SideBySideLinearGroup and layer.exl3_group == 512
    _outputs_are_the_shards(layer, ws, torch.randn(3, 256))


def test_sliced_shards_run_side_by_side_on_every_rank(tmp_path, rank):
    """A rank's slices that split 128-blocks (64-wide heads at tp 2): each shard's own sliced call, side by side in
    one op; the ranks' outputs side by side are the model's."""
    ws = _qkv_weights()
    x = torch.randn(3, 256)
    per_rank = []
    for r in range(2):
        layer = _qkv_layer(tmp_path / str(r), rank, ws, tp=2, r=r)
        assert type(layer.quant_method.group) is SideBySideLinearGroup and layer.exl3_group == 256
        per_rank.append(layer(x).split([128, 64, 64], -1))
    for i, (name, w) in enumerate(ws.items()):
        assert rel(torch.cat([p[i] for p in per_rank], -1), reference(x, w, 256, w.out_padded)) < 1e-5, name


def test_mixed_layer_with_plain_shards(tmp_path, rank):
    """`non_routed_exl3` long form: gate in EXL3, up kept BF16 (bf16_shards [1])."""
    rank(0, 1)
    gate = random_weights(256, 256, 4, "mcg", 7)
    up = torch.randn(256, 256).bfloat16()
    raw = {"non_routed_exl3": {"layers": {"m.gate_up_proj": {"bits": 4, "bf16_shards": [1]}}}}
    cfg, tensors = make_config(tmp_path, {"m.gate_proj": gate}, {"m.up_proj.weight": up}, raw,
                               packed={"gate_up_proj": ["gate_proj", "up_proj"]})
    layer = vllm_linear.MergedColumnParallelLinear(256, [256, 256], bias=False, quant_config=cfg,
                                                   prefix="m.gate_up_proj", return_bias=False)
    load(layer, tensors, {"m.gate_proj": 0, "m.up_proj": 1})
    x = torch.randn(3, 256)
    y = layer(x)
    assert rel(y[:, :256], reference(x, gate, 256, 256)) < 1e-5
    assert rel(y[:, 256:], x.double() @ up.double().T) < 1e-5


def test_declared_bf16_shard_that_is_exl3_is_an_error(tmp_path, rank):
    rank(0, 1)
    raw = {"non_routed_exl3": {"layers": {"m.gate_up_proj": {"bf16_shards": [1]}}}}
    cfg, _ = make_config(tmp_path, {"m.gate_proj": random_weights(256, 256, 4, "mcg", 7),
                                    "m.up_proj": random_weights(256, 256, 4, "mcg", 8)}, raw=raw,
                         packed={"gate_up_proj": ["gate_proj", "up_proj"]})
    with pytest.raises(Exl3ConfigError, match="lists shard 1 of 'm.gate_up_proj' as BF16"):
        vllm_linear.MergedColumnParallelLinear(256, [256, 256], bias=False, quant_config=cfg, prefix="m.gate_up_proj")


def test_declared_bits_mismatch_is_an_error(tmp_path, rank):
    rank(0, 1)
    raw = {"non_routed_exl3": {"modules": ["o_proj"], "bits": 3}}
    cfg, _ = make_config(tmp_path, {"a.o_proj": random_weights(256, 256, 4, "mcg", 9)}, raw=raw)
    with pytest.raises(Exl3ConfigError, match="declares 3 bits for 'a.o_proj' but 'a.o_proj' is stored at 4"):
        vllm_linear.RowParallelLinear(256, 256, bias=False, quant_config=cfg, prefix="a.o_proj")


def test_stale_plain_copy_is_checked_then_dropped(tmp_path, rank):
    rank(0, 1)
    w = random_weights(256, 128, 4, "mcg", 10)
    cfg, tensors = make_config(tmp_path, {"l.p": w}, {"l.p.weight": torch.randn(128, 256).bfloat16()})
    layer = vllm_linear.ReplicatedLinear(256, 128, bias=False, quant_config=cfg, prefix="l.p", return_bias=False)
    load(layer, tensors)
    x = torch.randn(2, 256)
    assert rel(layer(x), reference(x, w, 256, 128)) < 1e-5
    bad_cfg, _ = make_config(tmp_path / "bad", {"l.p": w}, {"l.p.weight": torch.randn(64, 256).bfloat16()})
    with pytest.raises(Exl3FormatError, match="stale plain copy"):
        vllm_linear.ReplicatedLinear(256, 128, bias=False, quant_config=bad_cfg, prefix="l.p")


def test_missing_tensor_is_named_after_loading(tmp_path, rank):
    rank(0, 1)
    w = random_weights(256, 128, 4, "mcg", 11)
    cfg, tensors = make_config(tmp_path, {"l.p": w})
    layer = vllm_linear.ReplicatedLinear(256, 128, bias=False, quant_config=cfg, prefix="l.p")
    del tensors["l.p.svh"]  # as if its shard file were never read
    with pytest.raises(Exl3FormatError, match=r"l\.p\.svh.*never delivered"):
        load(layer, tensors)


def test_wrong_model_geometry_is_refused(tmp_path, rank):
    rank(0, 1)
    cfg, _ = make_config(tmp_path, {"l.p": random_weights(256, 128, 4, "mcg", 12)})
    with pytest.raises(ValueError, match="stores 256 padded features but the model config gives 512"):
        vllm_linear.ReplicatedLinear(512, 128, bias=False, quant_config=cfg, prefix="l.p")


def test_layers_without_exl3_tensors_go_plain_or_to_the_delegate(tmp_path, rank):
    rank(0, 1)
    delegate = {"quant_method": "fp8", "activation_scheme": "dynamic"}
    for raw, expected in [({}, "UnquantizedLinearMethod"),
                          ({"non_routed_quantization": delegate}, "Fp8LinearMethod"),
                          ({"non_routed_quantization": delegate, "non_routed_dtype_policy": "bf16_as_stored"},
                           "UnquantizedLinearMethod")]:
        cfg, _ = make_config(tmp_path / str(len(raw)) / expected, {"l.exl3": random_weights(256, 128, 4, "mcg", 1)},
                             raw=raw)
        layer = vllm_linear.ReplicatedLinear(256, 128, bias=False, quant_config=cfg, prefix="l.plain")
        assert type(layer.quant_method).__name__ == expected, raw


@pytest.mark.parametrize("arch,layers,mtp,where", [
    ("Glm4MoeForCausalLM", 2, "model.layers.2", "MTP layer 2"),  # layers past num_hidden_layers
    ("Qwen3_5MoeForCausalLM", 4, "mtp", "MTP module mtp"),  # Qwen3-Next's, Qwen3.5's: under mtp., numbered from 0
], ids=["glm-layer-past-the-last", "qwen3.5-mtp-prefix"])
def test_mtp_layer_linears_are_built_from_what_the_pack_stores(tmp_path, rank, arch, layers, mtp, where):
    """The pack's MTP layers are built only by vLLM's `mtp` drafter: an EXL3 linear gets the EXL3 method (GLM's
    eh_proj as integration/models/glm4_moe_mtp.py builds it, Qwen3.5's fc as vLLM does: a tensor out, no bias), a
    plain weight vLLM's unquantized method, and a linear the pack stores nothing for is refused by name (vLLM would
    draft with uninitialised memory). A trunk layer without tensors is the pack check's business, not this one."""
    from types import SimpleNamespace

    rank(0, 1)
    proj = f"{mtp}.eh_proj" if mtp.startswith("model.") else f"{mtp}.fc"
    block = mtp if mtp.startswith("model.") else f"{mtp}.layers.0"
    eh = random_weights(512, 256, 4, "mcg", 21)
    tensors = {**linear_tensors(proj, eh), f"{block}.mlp.gate.weight": torch.randn(8, 256)}
    root = write_pack(tmp_path / "pack", tensors)
    cfg = Exl3Config({"quant_method": "exl3"})
    cfg.maybe_update_config(str(root), hf_config=SimpleNamespace(num_hidden_layers=layers, architectures=[arch]))
    cfg.packed_modules_mapping = {}
    layer = vllm_linear.ReplicatedLinear(512, 256, bias=False, quant_config=cfg, prefix=proj, return_bias=False)
    load(layer, tensors)
    x = torch.randn(3, 512)
    assert rel(layer(x), reference(x, eh, 512, 256)) < 1e-5
    gate = vllm_linear.ReplicatedLinear(256, 8, bias=False, quant_config=cfg, prefix=f"{block}.mlp.gate")
    assert type(gate.quant_method).__name__ == "UnquantizedLinearMethod"
    with pytest.raises(Exl3FormatError, match=rf"{re.escape(block)}\.self_attn\.o_proj.*{where}.*none in the pack"):
        vllm_linear.ReplicatedLinear(256, 256, bias=False, quant_config=cfg, prefix=f"{block}.self_attn.o_proj")
    trunk = vllm_linear.ReplicatedLinear(256, 256, bias=False, quant_config=cfg,
                                         prefix="model.layers.1.self_attn.o_proj")
    assert type(trunk.quant_method).__name__ == "UnquantizedLinearMethod"


@pytest.mark.parametrize("tp", [1, 2])
def test_exl3_lm_head_with_vocab_padding(tmp_path, rank, tp, monkeypatch):
    """vocab 2000 (pack pads to 2048, vLLM pads each rank's share to 64): logits of real tokens match."""
    from vllm.model_executor.layers import vocab_parallel_embedding as vpe

    w = random_weights(256, 2000, 6, "mul1", 13)
    cfg, tensors = make_config(tmp_path, {"lm_head": w})
    x = torch.randn(3, 256)
    outs = []
    for r in range(tp):
        monkeypatch.setattr(vpe, "get_tensor_model_parallel_rank", lambda r=r: r)
        monkeypatch.setattr(vpe, "get_tensor_model_parallel_world_size", lambda: tp)
        head = ParallelLMHead(2000, 256, quant_config=cfg, prefix="lm_head")
        load(head, tensors)
        y = head.quant_method.apply(head, x)
        assert y.shape == (3, head.num_embeddings_per_partition)
        si = head.shard_indices
        outs.append(y[:, : si.org_vocab_end_index - si.org_vocab_start_index])
        assert y[:, si.org_vocab_end_index - si.org_vocab_start_index:].abs().sum() == 0
    assert rel(torch.cat(outs, -1), reference(x, w, 256, 2000)) < 1e-5


def test_codebook_declaration_contradicting_markers(tmp_path):
    with pytest.raises(Exl3ConfigError, match="codebook is 'mul1' but 'l.p' is stored with the mcg codebook"):
        make_config(tmp_path, {"l.p": random_weights(256, 128, 4, "mcg", 1)}, raw={"codebook": "mul1"})


@pytest.mark.parametrize("raw, message", [
    ({"codebook": "fp4"}, "codebook must be one of"),
    ({"non_routed_dtype_policy": "bf8"}, "non_routed_dtype_policy must be one of"),
    ({"non_routed_quantization": {"bits": 8}}, "non_routed_quantization must be a quantization_config"),
    ({"non_routed_quantization": {"quant_method": "exl3"}}, "cannot itself be exl3"),
    ({"non_routed_dtype_policy": "official_source_native"}, "needs non_routed_quantization"),
    ({"layer_bits": {"three": 3}}, "layer_bits must map layer indices"),
    ({"non_routed_exl3": {"layers": {"x.o_proj": {"bf16_shards": ["v"]}}}}, "bf16_shards must list shard indices"),
])
def test_contract_errors(raw, message):
    """A malformed contract stops the start in `maybe_update_config`, which vLLM calls right after building the
    config (for a local pack, the pack check names config.json first: tests/cli/test_fail_closed_packs.py)."""
    from vllm_exl3.format.contract import Contract

    with pytest.raises(Exl3ConfigError, match=message):
        Contract.parse({"quant_method": "exl3", **raw})
    cfg = Exl3Config({"quant_method": "exl3", **raw})
    with pytest.raises(Exl3ConfigError, match=message):
        cfg.maybe_update_config(str(pack_dir("qwen3moe-a-exl3-mcg-b3")))
    with pytest.raises(Exl3ConfigError, match=message):  # and a layer built without it
        cfg.get_quant_method(None, "model.layers.0.self_attn.o_proj")


def test_a_delegate_method_vllm_does_not_have_is_refused_by_name():
    """It passed every gate, then vLLM's "Invalid quantization method" ended the load at the first dense layer."""
    cfg = Exl3Config({"quant_method": "exl3", "non_routed_quantization": {"quant_method": "fp9"}})
    with pytest.raises(Exl3ConfigError, match="non_routed_quantization: quant_method 'fp9' is not a quantization "
                                              "method of this vLLM"):
        cfg.maybe_update_config(str(pack_dir("qwen3moe-a-exl3-mcg-b3")))


@pytest.mark.parametrize("layer", [0, 7])
def test_layer_bits_declaration_is_checked_for_every_layer(layer):
    """`layer_bits` keys are layer indices; layer 0 is a key like any other."""
    from vllm_exl3.format.contract import Contract
    from vllm_exl3.format.index import LinearMeta

    contract = Contract.parse({"layer_bits": {str(layer): 3}})
    prefix = f"model.layers.{layer}.mlp.experts"
    contract.check_expert_bits(prefix, [(f"{prefix}.0.gate_proj", LinearMeta(3.0, "mcg", 256, 128))])
    with pytest.raises(Exl3ConfigError, match=f"declares 3 bits for layer {layer} but"):
        contract.check_expert_bits(prefix, [(f"{prefix}.0.gate_proj", LinearMeta(4.0, "mcg", 256, 128))])
    contract.check_expert_bits("model.layers.99.mlp.experts", [("x", LinearMeta(4.0, "mcg", 256, 128))])


@pytest.fixture
def native_stand_in(tmp_path, monkeypatch):
    """install(backend, policy): a test-only backend (support/backends.py) registered as `native`, the parity gate
    under `policy`; the gate's and the bindings' state cleared before and after."""
    from vllm_exl3.integration import binding
    from vllm_exl3.kernels import backend as kbackend, parity, selection

    def install(backend, policy: str) -> None:
        kbackend.load_backends()
        monkeypatch.setitem(kbackend.REGISTRY, "native", backend)
        monkeypatch.setattr(selection, "_excluded", {})
        monkeypatch.setenv(parity.PARITY_ENV, policy)
        monkeypatch.setenv(parity.REPORT_ENV, str(tmp_path / "parity.json"))
        parity.reset()
        binding.reset()

    yield install
    parity.reset()
    binding.reset()


@pytest.mark.parametrize("policy", ["fallback", "strict"])
def test_parity_gate_at_load_on_a_real_layer(tmp_path, rank, native_stand_in, policy):
    """A broken backend (test-only) chosen for a vLLM layer: `fallback` binds the layer to the torch reference
    at load (output exact), `strict` refuses to load naming the layer."""
    from vllm_exl3.kernels import parity
    from support.backends import WrongNative

    native_stand_in(WrongNative(), policy)
    rank(0, 1)
    w = random_weights(256, 384, 3, "mcg", seed=1)
    cfg, tensors = make_config(tmp_path, {"model.layers.0.up": w})
    layer = vllm_linear.ColumnParallelLinear(256, 384, bias=False, quant_config=cfg, prefix="model.layers.0.up",
                                             return_bias=False)
    if policy == "strict":
        with pytest.raises(parity.ParityError, match=r"layer model\.layers\.0\.up .*native backend"):
            load(layer, tensors)
        return
    load(layer, tensors)
    x = torch.randn(5, 256)
    assert rel(layer(x), reference(x, w, 256, 384)) < 1e-5
    assert layer.quant_method.bound[0].backend == "torch"  # the backend the gate moved the layer to
    assert ops.serving(layer.exl3_trellis_0) is layer.quant_method.bound[0]  # and the op runs that binding


@pytest.mark.parametrize("policy", ["fallback", "strict"])
def test_parity_gate_checks_the_grouped_call_on_its_own(tmp_path, rank, native_stand_in, policy):
    """Right shards, a wrong grouped call (test-only backend): `fallback` keeps the shards on their backend and
    calls them side by side (output exact), `strict` refuses to load naming the grouped layer."""
    from vllm_exl3.kernels import parity
    from support.backends import WrongGroupNative

    native_stand_in(WrongGroupNative(), policy)
    ws = _qkv_weights()
    if policy == "strict":
        with pytest.raises(parity.ParityError, match=r"layer a\.qkv_proj \(grouped\) .*native backend"):
            _qkv_layer(tmp_path, rank, ws)
        return
    layer = _qkv_layer(tmp_path, rank, ws)
    assert type(layer.quant_method.group) is SideBySideLinearGroup and layer.quant_method.group.backend == "native"
    assert {b.backend for b in layer.quant_method.bound.values()} == {"native"}
    _outputs_are_the_shards(layer, ws, torch.randn(4, 256))


def test_kernel_choice_enters_vllms_compile_key(tmp_path, rank):
    """vLLM hashes VllmConfig.additional_config into its torch.compile cache key and knows nothing else of our
    backends: binding a layer records the backend chosen per layer type there (integration/compile_key.py), so a
    boot that binds another backend gets its own cache entry instead of a graph compiled for the first."""
    from vllm.config import get_current_vllm_config

    from vllm_exl3.integration import compile_key
    from vllm_exl3.kernels import selection

    vllm_config = get_current_vllm_config()
    vllm_config.additional_config.pop(compile_key.KEY, None)
    before = vllm_config.compute_hash()
    rank(0, 1)
    w = random_weights(256, 128, 4, "mul1", seed=3)
    cfg, tensors = make_config(tmp_path, {"l.key": w})
    layer = vllm_linear.ColumnParallelLinear(256, 128, bias=False, quant_config=cfg, prefix="l.key",
                                             return_bias=False)
    load(layer, tensors)
    key = vllm_config.additional_config[compile_key.KEY]
    assert "linear:mul1:4b:cpu=torch" in key["layers"] and key["builds"]["torch"] == ""
    bound = vllm_config.compute_hash()
    assert bound != before
    other = selection.Decision("linear:mul1:4b:cpu", "native", ())
    selection._record(other)  # what a process that bound the native backend has recorded
    try:
        compile_key.record()
        assert vllm_config.compute_hash() not in (before, bound)
    finally:
        selection._decision_counts.pop(other)
        compile_key.record()
    assert vllm_config.compute_hash() == bound


def test_worker_state_is_published_once_per_load(tmp_path, rank, monkeypatch):
    """Binding a model's layers writes the metrics exporter's state file once, after the last layer, not once per
    layer (integration/telemetry.py): counted at the atomic writer every publish goes through."""
    import json
    import time

    from vllm_exl3.integration import telemetry
    from vllm_exl3.kernels import selection

    writes = []
    real_write = telemetry.write_json

    def counting_write(path, body, *args, **kwargs):
        writes.append(body)
        return real_write(path, body, *args, **kwargs)

    monkeypatch.setenv("VLLM_EXL3_STATE_DIR", str(tmp_path / "state"))
    telemetry.flush()  # what earlier tests left pending goes now, before counting
    monkeypatch.setattr(telemetry, "write_json", counting_write)
    monkeypatch.setattr(telemetry, "QUIET_S", 2.0)  # binding 12 tiny layers takes far less, even on a busy CI box
    rank(0, 1)
    prefixes = [f"model.layers.{i}.mlp.down_proj" for i in range(12)]
    cfg, tensors = make_config(tmp_path, {p: random_weights(128, 128, 2, "3inst", seed=4 + i)
                                          for i, p in enumerate(prefixes)})
    layer_type = "linear:3inst:2b:cpu"
    bound_before = sum(n for d, n in selection.decision_counts().items() if d.layer_type == layer_type)
    for prefix in prefixes:
        layer = vllm_linear.RowParallelLinear(128, 128, bias=False, quant_config=cfg, prefix=prefix,
                                              reduce_results=False, return_bias=False)
        load(layer, tensors)
    deadline = time.monotonic() + 30
    while not writes and time.monotonic() < deadline:
        time.sleep(0.1)
    time.sleep(2 * telemetry.QUIET_S)  # a second write would come within this
    assert len(writes) == 1, f"{len(writes)} writes for {len(prefixes)} layers"
    published = json.loads((tmp_path / "state" / "exl3-rank0.json").read_text())
    assert [d["layers"] for d in published["decisions"] if d["layer_type"] == layer_type] == \
        [bound_before + len(prefixes)]  # written after the last layer was bound


# -- a MoE router's gate (16-bit, not EXL3) on the plugin's backends ---------------------------------------------
GATE = "model.layers.0.mlp.gate"


def _gate(tmp_path, dtype: torch.dtype, out_dtype: torch.dtype | None, seed: int = 5):
    """vLLM's own GateLinear (what Qwen3-MoE builds) with our config, its weight loaded through its loader."""
    from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear

    cfg, _ = make_config(tmp_path, {"model.layers.0.mlp.down_proj": random_weights(128, 256, 4, "mcg", seed)})
    layer = GateLinear(256, 16, out_dtype=out_dtype, params_dtype=dtype, quant_config=cfg, prefix=GATE)
    w = (torch.randn(16, 256, generator=torch.Generator().manual_seed(seed)) / 16).to(dtype)
    load(layer, {f"{GATE}.weight": w})
    return layer, w


@pytest.mark.parametrize("setting", [None, "auto", "0"])
def test_router_gate_is_vllms_own_where_the_native_backend_does_not_serve(tmp_path, rank, monkeypatch, setting):
    """The default (auto) without the native backend (here: no CUDA GPU), and 0 anywhere: vLLM's own gate GEMM."""
    if setting is None:
        monkeypatch.delenv("VLLM_EXL3_ROUTER_GATE", raising=False)
    else:
        monkeypatch.setenv("VLLM_EXL3_ROUTER_GATE", setting)
    rank(0, 1)
    layer, _ = _gate(tmp_path, torch.bfloat16, torch.float32)
    assert type(layer.quant_method).__name__ == "UnquantizedLinearMethod" and layer.is_unquantized


@pytest.mark.parametrize("kernel,on", [("auto", True), ("native", True), ("torch", False), ("exllamav3", False)])
def test_router_gate_defaults_to_the_plugins_backend_where_native_serves(tmp_path, rank, monkeypatch,
                                                                          native_stand_in, kernel, on):
    """auto (the default) with the native backend available (a stand-in here): the gate is the plugin's where the
    native backend serves the model (VLLM_EXL3_KERNEL auto or native), vLLM's where another backend was asked for."""
    from support.backends import NativeStandIn
    from vllm_exl3.integration.router_gate import RouterGateMethod
    from vllm_exl3.kernels import selection

    native_stand_in(NativeStandIn(), "fallback")
    monkeypatch.delenv("VLLM_EXL3_ROUTER_GATE", raising=False)
    monkeypatch.setenv("VLLM_EXL3_KERNEL", kernel)
    assert selection.router_gate_on() is on
    if kernel in ("auto", "native"):
        rank(0, 1)
        layer, w = _gate(tmp_path, torch.bfloat16, torch.float32)
        assert isinstance(layer.quant_method, RouterGateMethod) and layer.quant_method.backend.name == "native"
        x = torch.randn(3, 256).to(torch.bfloat16)
        assert torch.equal(layer(x)[0], x.float() @ w.float().t())


@pytest.mark.parametrize("dtype,out_dtype", [(torch.bfloat16, torch.float32), (torch.bfloat16, None),
                                             (torch.float16, torch.float32), (torch.float32, None)])
def test_router_gate_on_the_plugins_backend(tmp_path, rank, monkeypatch, dtype, out_dtype):
    """VLLM_EXL3_ROUTER_GATE=1: vLLM's GateLinear calls our method (its own GEMM tiers off), which serves the
    logits from the chosen backend in the gate's out_dtype (on CPU the torch reference's fp32 product), recorded
    in vLLM's compile-cache key under the gate's own layer type."""
    from vllm.config import get_current_vllm_config

    from vllm_exl3.integration import compile_key
    from vllm_exl3.integration.router_gate import RouterGateMethod

    monkeypatch.setenv("VLLM_EXL3_ROUTER_GATE", "1")
    rank(0, 1)
    layer, w = _gate(tmp_path, dtype, out_dtype)
    assert isinstance(layer.quant_method, RouterGateMethod) and not layer.is_unquantized
    assert layer.quant_method.backend.name == "torch"
    x = torch.randn(5, 256).to(dtype)
    y, _ = layer(x)
    expected = x.float() @ w.float().t()
    assert y.dtype == (out_dtype or dtype)
    assert torch.equal(y, expected if out_dtype == torch.float32 else expected.to(dtype))
    short = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}[dtype]
    assert f"router_gate:{short}:cpu=torch" in get_current_vllm_config().additional_config[compile_key.KEY]["layers"]


@pytest.mark.parametrize("policy", ["fallback", "strict"])
def test_parity_gate_checks_the_router_gate(tmp_path, rank, monkeypatch, native_stand_in, policy):
    """A router gate 10 % off on the backend chosen for it (test-only): `fallback` moves the gate to the torch
    reference at load (output exact), `strict` refuses to load naming the gate."""
    from vllm_exl3.kernels import parity
    from support.backends import WrongRouterGateNative

    native_stand_in(WrongRouterGateNative(), policy)
    monkeypatch.setenv("VLLM_EXL3_ROUTER_GATE", "1")
    rank(0, 1)
    if policy == "strict":
        with pytest.raises(parity.ParityError, match=rf"layer {GATE} \(router_gate:bf16:cpu\) .*native backend"):
            _gate(tmp_path, torch.bfloat16, torch.float32)
        return
    layer, w = _gate(tmp_path, torch.bfloat16, torch.float32)
    assert layer.quant_method.backend.name == "torch"
    x = torch.randn(3, 256).to(torch.bfloat16)
    assert torch.equal(layer(x)[0], x.float() @ w.float().t())
    (check,) = [c for c in parity.checks() if c.layer == GATE]
    assert not check.passed and 0.09 < check.error < 0.11
    assert check.inputs == "rows " + ",".join(map(str, parity.ROUTER_GATE_ROWS))


# ---------------------------------------------------------------------------------------------------------------
# Checkpoint linears spanning several output sizes of a merged layer (vLLM's stacked weights mapper: a tuple id)
@pytest.mark.parametrize("tp", [1, 2, 4])
@pytest.mark.parametrize("kd", [64, 128])
def test_qwen35_qkv_and_z_fill_the_four_entries_of_in_proj_qkvz(tmp_path, rank, tp, kd):
    """Qwen3.5's GDN projection: vLLM builds in_proj_qkvz with output sizes [key, key, value, value] and loads
    `in_proj_qkv` as shard (0, 1, 2), `in_proj_z` as 3. Each rank holds its slice of every entry, so of the one stored
    in_proj_qkv it holds three ranges (q, k, v), 128-aligned or not (kd 64 at tp 2 splits a block)."""
    vd = 2 * kd
    qkv, z = random_weights(256, 2 * kd + vd, 3, "mcg", 21), random_weights(256, vd, 4, "mul1", 22)
    cfg, tensors = make_config(tmp_path, {"g.in_proj_qkv": qkv, "g.in_proj_z": z},
                               packed={"in_proj_qkvz": ["in_proj_qkv", "in_proj_z"]})
    x = torch.randn(3, 256)
    want = torch.cat([reference(x, qkv, 256, 2 * kd + vd), reference(x, z, 256, vd)], -1)
    sizes = [kd, kd, vd, vd]
    pieces = [[] for _ in sizes]
    for r in range(tp):
        rank(r, tp)
        layer = vllm_linear.MergedColumnParallelLinear(256, sizes, bias=False, quant_config=cfg,
                                                       prefix="g.in_proj_qkvz", return_bias=False)
        assert [s.shard_id for s in layer.quant_method.shards][-1] == 3
        assert {s.shard_id for s in layer.quant_method.shards} == {(0, 1, 2), 3}
        assert len(layer.quant_method.shards) == (2 if tp == 1 else 4)  # at tp 1 q, k, v are one range
        load(layer, tensors, {"g.in_proj_qkv": (0, 1, 2), "g.in_proj_z": 3})
        for i, p in enumerate(layer(x).split([n // tp for n in sizes], -1)):
            pieces[i].append(p)
    assert rel(torch.cat([torch.cat(p, -1) for p in pieces], -1), want) < 1e-5


def test_merged_layer_placement_must_be_unique(tmp_path, rank):
    """A pack whose widths fit vLLM's output sizes no way (or several) is refused when the layer is built."""
    rank(0, 1)
    cfg, _ = make_config(tmp_path, {"g.in_proj_qkv": random_weights(256, 384, 3, "mcg", 23),
                                    "g.in_proj_z": random_weights(256, 384, 3, "mcg", 24)},
                         packed={"in_proj_qkvz": ["in_proj_qkv", "in_proj_z"]})
    with pytest.raises(Exl3FormatError, match="0 ways"):
        vllm_linear.MergedColumnParallelLinear(256, [128, 128, 256, 256], bias=False, quant_config=cfg,
                                               prefix="g.in_proj_qkvz")


@pytest.mark.parametrize("tp", [1, 2])
def test_qkv_fused_on_disk(tmp_path, rank, tp):
    """A vision tower's `attn.qkv` is one EXL3 linear in a QKVParallelLinear (vLLM's mapping `qkv: [qkv]`, loaded
    without a shard id): each rank keeps its q, k and v head slices of it."""
    w = random_weights(256, 3 * 4 * 64, 3, "mcg", 25)
    cfg, tensors = make_config(tmp_path, {"v.attn.qkv": w}, packed={"qkv": ["qkv"]})
    x = torch.randn(3, 256)
    want = reference(x, w, 256, 768).split([256] * 3, -1)
    per_rank = []
    for r in range(tp):
        rank(r, tp)
        layer = vllm_linear.QKVParallelLinear(256, 64, 4, 4, bias=False, quant_config=cfg, prefix="v.attn.qkv",
                                              return_bias=False)
        load(layer, tensors)
        per_rank.append(layer(x).split([256 // tp] * 3, -1))
    for i in range(3):
        assert rel(torch.cat([p[i] for p in per_rank], -1), want[i]) < 1e-5


def test_index_takes_vllms_names_for_top_level_modules(tmp_path):
    """vLLM's multimodal models map `lm_head.` to `language_model.lm_head.` (a prefix rule with the dot): the index
    follows for the head as for every layer (Qwen3.5 packs in their Qwen3_5MoeForConditionalGeneration layout)."""
    from vllm.model_executor.models.utils import WeightsMapper

    down = "model.language_model.layers.0.mlp.down_proj"
    cfg, _ = make_config(tmp_path, {"lm_head": random_weights(256, 384, 3, "mcg", 26),
                                    down: random_weights(256, 256, 3, "mcg", 27)},
                         {"model.language_model.layers.0.mlp.gate.weight": torch.randn(8, 256)})
    cfg.apply_vllm_mapper(WeightsMapper(orig_to_new_prefix={
        "model.visual.": "visual.", "lm_head.": "language_model.lm_head.",
        "model.language_model.": "language_model.model.", "mtp.": None}))
    assert set(cfg.index.exl3) == {"language_model.lm_head", "language_model.model.layers.0.mlp.down_proj"}
    assert set(cfg.index.plain) == {"language_model.model.layers.0.mlp.gate"}
