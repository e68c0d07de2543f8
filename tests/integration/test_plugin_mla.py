"""MLA support (integration/mla.py), in-process on real vLLM classes.

An EXL3 `kv_b_proj` under MLA is decoded once at load: vLLM's own `get_and_maybe_dequant_weights` (what
`MLAAttention.process_weights_after_loading` builds W_UK / W_UV from) must return exactly the reference weight,
per tensor-parallel rank, and the layer's forward (vLLM's prefill path) must match it too. The served end of it
(CPU MLA, logits against transformers) is scratch work recorded in NOTES; it needs kv_lora_rank 512.
"""

from __future__ import annotations

import tempfile
from types import SimpleNamespace

import pytest
import torch

vllm = pytest.importorskip("vllm")

import vllm_exl3  # noqa: E402
from vllm_exl3.dev.synthetic import linear_tensors, random_weights, write_pack  # noqa: E402
from vllm_exl3.format import reference as R  # noqa: E402

vllm_exl3.register()

from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.distributed import init_distributed_environment  # noqa: E402
from vllm.distributed.parallel_state import (  # noqa: E402
    ensure_model_parallel_initialized,
    model_parallel_is_initialized,
)
from vllm.model_executor.layers import linear as vllm_linear  # noqa: E402
from vllm.model_executor.layers.quantization.utils.quant_utils import get_and_maybe_dequant_weights  # noqa: E402

from vllm_exl3.integration import mla  # noqa: E402
from vllm_exl3.integration.config import Exl3Config  # noqa: E402

from support.fixtures import pack_dir  # noqa: E402

KV_LORA, HEADS, NOPE, V = 512, 4, 64, 64  # GLM-4.7-Flash's kv_lora_rank; fewer, narrower heads


@pytest.fixture(scope="module", autouse=True)
def vllm_context():
    # test_plugin_layers.py (collected first) initializes the single-rank groups unconditionally; alone, this does
    mc = ModelConfig(model=str(pack_dir("qwen3moe-a-exl3-mul1-b4")), dtype="float32")
    with set_current_vllm_config(VllmConfig(model_config=mc)):
        if not model_parallel_is_initialized():
            init_distributed_environment(world_size=1, rank=0, local_rank=0, backend="gloo",
                                         distributed_init_method=f"file://{tempfile.mktemp()}")
            ensure_model_parallel_initialized(1, 1)
        yield


def _kv_b_layer(tmp_path, monkeypatch, w, r: int, tp: int, use_mla: bool = True):
    monkeypatch.setattr(vllm_linear, "get_tensor_model_parallel_rank", lambda: r)
    monkeypatch.setattr(vllm_linear, "get_tensor_model_parallel_world_size", lambda: tp)
    monkeypatch.setattr(mla, "decoded_at_load", lambda prefix, _: use_mla and prefix.endswith(".kv_b_proj"))
    prefix = "model.layers.0.self_attn.kv_b_proj"
    tensors = linear_tensors(prefix, w)
    cfg = Exl3Config({"quant_method": "exl3"})
    cfg.maybe_update_config(str(write_pack(tmp_path / f"pack{r}", tensors)))
    layer = vllm_linear.ColumnParallelLinear(KV_LORA, HEADS * (NOPE + V), bias=False, quant_config=cfg,
                                             prefix=prefix, return_bias=False)
    for name, t in tensors.items():
        param = getattr(layer, name.rpartition(".")[2])
        param.weight_loader(param, t)
    layer.quant_method.process_weights_after_loading(layer)
    return layer


@pytest.mark.parametrize("tp", [1, 2])
def test_mla_kv_b_proj_is_decoded_once_for_vllms_absorb(tmp_path, monkeypatch, tp):
    """What MLAAttention reads (get_and_maybe_dequant_weights: `.weight` for its device, then the method's apply on
    an identity) is the reference weight of this rank's heads; the EXL3 tensors are gone; prefill's forward agrees."""
    w = random_weights(KV_LORA, HEADS * (NOPE + V), 4, "mcg", seed=11)
    full = R.full_weight(w).double()[:KV_LORA, :HEADS * (NOPE + V)].t()  # [out, in]
    x = torch.randn(3, KV_LORA)
    for r in range(tp):
        layer = _kv_b_layer(tmp_path, monkeypatch, w, r, tp)
        rows = full[r * full.shape[0] // tp:(r + 1) * full.shape[0] // tp]
        assert getattr(layer, "exl3_decoded", False) and not hasattr(layer, "trellis")
        assert torch.equal(get_and_maybe_dequant_weights(layer, out_dtype=torch.float32), layer.weight)
        assert (layer.weight.double() - rows).abs().max() < 1e-5
        assert ((layer(x).double() - x.double() @ rows.t()).norm() / (x.double() @ rows.t()).norm()) < 1e-6


def test_kv_b_proj_stays_exl3_without_mla(tmp_path, monkeypatch):
    """VLLM_MLA_DISABLE=1 (per-head K/V): kv_b_proj is an ordinary GEMM every step and keeps its EXL3 kernel."""
    w = random_weights(KV_LORA, HEADS * (NOPE + V), 3, "mul1", seed=12)
    layer = _kv_b_layer(tmp_path, monkeypatch, w, 0, 1, use_mla=False)
    assert hasattr(layer, "trellis") and not hasattr(layer, "weight")
    x = torch.randn(2, KV_LORA)
    ref = x.double() @ R.full_weight(w).double()[:KV_LORA, :HEADS * (NOPE + V)]
    assert ((layer(x).double() - ref).norm() / ref.norm()) < 1e-5


def test_decoded_at_load_needs_mla_and_kv_b_proj():
    on, off = (SimpleNamespace(model_config=SimpleNamespace(use_mla=v)) for v in (True, False))
    assert mla.decoded_at_load("model.layers.3.self_attn.kv_b_proj", on)
    assert not mla.decoded_at_load("model.layers.3.self_attn.kv_b_proj", off)
    assert not mla.decoded_at_load("model.layers.3.self_attn.q_b_proj", on)
    assert not mla.decoded_at_load("model.layers.3.self_attn.kv_b_proj", None)
