"""dev/trellis.py (EXL3 linears that decode to a chosen weight) and dev/mtp.py (a GLM-4.5 pack with its MTP layer, and
what that layer drafts; a Qwen3.5-MoE pack with its `mtp.` module): the pieces tests/e2e/test_speculative_e2e.py
serves `mtp` with."""

from __future__ import annotations

import pytest
import torch
from support.fixtures import pack_dir
from vllm_exl3.appliance.preflight import check_speculative
from vllm_exl3.dev import mtp
from vllm_exl3.dev.trellis import encode_tiles, encoded_weights, trellis_words
from vllm_exl3.format import reference as R
from vllm_exl3.format.pack import Pack

GLM = pack_dir("glm4moe-a-exl3-mcg-b4")


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).norm() / b.norm()).item()


@pytest.mark.parametrize("bits", [1, 3, 8])
def test_symbols_land_where_the_decoder_reads_them(bits):
    """The ring trellis_words writes is the one format/reference.py reads: the state of position t is the 16 ring
    bits ending with symbol t (the ring closing over its end)."""
    g = torch.Generator().manual_seed(bits)
    symbols = torch.randint(0, 1 << bits, (2, 256), generator=g)
    states = R.trellis_states(trellis_words(symbols, bits).view(1, 2, 16 * bits))[0]  # [2, 16, 16] row-major
    ring = ((symbols[:, :, None] >> torch.arange(bits - 1, -1, -1)) & 1).reshape(2, -1)
    for t in (0, 1, 17, 255):
        end = (t + 1) * bits
        window = torch.roll(ring, -(end - 16), dims=1)[:, :16]
        expected = (window << torch.arange(15, -1, -1)).sum(-1)
        r, c = R.tile_position(t)
        assert states[:, r, c].tolist() == expected.tolist(), t


@pytest.mark.parametrize("codebook,widths", [("mcg", (2, 4, 6)), ("mul1", (4,)), ("3inst", (4,))])
def test_encoded_tiles_come_closer_with_every_bit(codebook, widths):
    """Two tiles of unit-Gaussian weights: the search's error falls with the bit width, and at 4 bits is far below a
    random ring's (any tiles decode to some weight; these decode to the one asked for)."""
    g = torch.Generator().manual_seed(0)
    targets = torch.randn(2, 256, generator=g)
    errors = [encode_tiles(targets, b, codebook)[1].mean().item() for b in widths]
    assert errors == sorted(errors, reverse=True) and errors[widths.index(4)] < 0.02, errors
    symbols = torch.randint(0, 16, (2, 256), generator=g)
    states = R.trellis_states(trellis_words(symbols, 4).view(1, 2, 64))[0].reshape(2, 256)
    positions = [r * 16 + c for r, c in map(R.tile_position, range(256))]
    random = R.codebook_lut(codebook).float()[states][:, positions]
    assert ((random - targets) ** 2).mean().item() > 1, "a random ring is no encoding"


def test_encoded_linear_decodes_to_its_weight():
    """Through the rotations and scales of the full weight (format/reference.py full_weight)."""
    weight = torch.zeros(256, 128)
    weight[:128] = torch.eye(128) * 0.3
    weight[128:] = -torch.eye(128) * 0.1
    suh, svh = torch.full((256,), 0.5), torch.full((128,), 0.4)
    assert rel(R.full_weight(encoded_weights(weight, 4, "mcg", suh, svh)), weight) < 0.3
    assert rel(R.full_weight(encoded_weights(weight, 8, "mcg", suh, svh)), weight) < 0.05


def test_rows_with_zero_scale_decode_to_zero_and_must_be_zero():
    weight = torch.zeros(256, 128)
    weight[128:, :] = torch.eye(128)
    suh = torch.ones(256)
    suh[:128] = 0
    w = R.full_weight(encoded_weights(weight, 8, "mcg", suh, torch.ones(128)))
    assert w[:128].abs().max() == 0 and rel(w, weight) < 0.05
    with pytest.raises(ValueError, match="must be 0 in the rows where suh is 0"):
        encoded_weights(weight, 8, "mcg", torch.zeros(256), torch.ones(128))
    with pytest.raises(ValueError, match="integer 1-8"):
        encoded_weights(weight, 2.5, "mul1", suh, torch.ones(128))


def test_search_closes_the_ring_at_the_least_error():
    """A tile the trellis can hold exactly (the decoded values of any symbol ring) is found with zero error."""
    g = torch.Generator().manual_seed(3)
    symbols = torch.randint(0, 16, (1, 256), generator=g)
    states = R.trellis_states(trellis_words(symbols, 4).view(1, 1, 64))[0, 0]
    values = R.codebook_lut("mcg").float()[states]
    target = torch.stack([values[R.tile_position(t)] for t in range(256)])[None]
    _, error = encode_tiles(target, 4, "mcg")
    assert error.item() == 0


@pytest.fixture(scope="module")
def packs(tmp_path_factory):
    root = tmp_path_factory.mktemp("mtp")
    return mtp.add_mtp_layer(GLM, root / "a", seed=0), mtp.add_mtp_layer(GLM, root / "b", seed=1)


def test_the_mtp_layer_is_stored_as_exllamav3_lays_it_out(packs):
    pack = Pack.open(packs[0])
    assert pack.problems() == [] and pack.mtp_missing() is None
    assert check_speculative(pack, {"method": "mtp", "num_speculative_tokens": 1}).ok
    n = pack.config["num_hidden_layers"]
    layer = {name[len(f"model.layers.{n}."):] for name in pack.tensors if name.startswith(f"model.layers.{n}.")}
    linears = {p[len(f"model.layers.{n}."):]: lin for p, lin in pack.linears().items()
               if p.startswith(f"model.layers.{n}.")}
    assert {"enorm.weight", "hnorm.weight", "shared_head.norm.weight", "mlp.gate.weight",
            "mlp.gate.e_score_correction_bias"} <= layer
    assert not any(t.startswith(("embed_tokens", "shared_head.head")) for t in layer)  # the target's are shared
    assert {"eh_proj", "self_attn.q_proj", "self_attn.o_proj", "mlp.shared_experts.down_proj",
            "mlp.experts.7.up_proj"} <= set(linears)
    assert {(lin.bits, lin.codebook) for lin in linears.values()} == {(4.0, "mcg")}  # the pack's
    assert pack.tensors[f"model.layers.{n}.mlp.gate.weight"].dtype == "F16"


def test_eh_proj_passes_the_hidden_state_through():
    h = 256
    w = R.full_weight(mtp.pass_through(h, 4, "mcg"))
    assert w[:h].abs().max() == 0  # the token embedding's half: not read
    assert rel(w[h:], torch.eye(h)) < 0.3 and abs(torch.diagonal(w[h:]).mean().item() - 1) < 0.02
    w = R.full_weight(mtp.pass_through(h, 4, "mul1", "embedding"))  # Qwen3.5's fc: the token embedding's half
    assert w[h:].abs().max() == 0  # the hidden state's half: not read
    assert rel(w[:h], torch.eye(h)) < 0.4 and abs(torch.diagonal(w[:h]).mean().item() - 1) < 0.02  # mul1: coarser


def test_the_qwen35_mtp_module_is_stored_as_exllamav3_lays_it_out(tmp_path):
    """ExLlamaV3 1.6.5's Qwen3.5-MoE MTP model (architecture/qwen3_5_mtp.py): under `mtp.`, fc and one gated-attention
    routed decoder layer, every linear EXL3 at mtp_bits (4) but the router and shared_expert_gate (plain fp16); the
    norms plain; no embedding or head of its own; the sidecar's ledger records every new tensor."""
    pack = Pack.open(mtp.add_mtp_layer(pack_dir("..") / "exl3-families" / "qwen35moe-a-exl3-mul1-b3.5",
                                       tmp_path / "pack"))
    assert pack.problems() == [] and pack.mtp_missing() is None
    assert check_speculative(pack, {"method": "mtp", "num_speculative_tokens": 1}).ok
    assert pack.config["mtp_num_hidden_layers"] == 1 and pack.quantization_config["mtp_bits"] == 4
    names = {n for n in pack.tensors if n.startswith("mtp.")}
    linears = {p: lin for p, lin in pack.linears().items() if p.startswith("mtp.")}
    assert {"mtp.fc", "mtp.layers.0.self_attn.q_proj", "mtp.layers.0.self_attn.o_proj",
            "mtp.layers.0.mlp.shared_expert.down_proj", "mtp.layers.0.mlp.experts.7.up_proj"} <= set(linears)
    assert linears["mtp.layers.0.self_attn.q_proj"].out_padded == 2 * 4 * 64  # query and gate
    assert {(lin.bits, lin.codebook) for lin in linears.values()} == {(4.0, "mul1")}
    assert {"mtp.pre_fc_norm_hidden.weight", "mtp.pre_fc_norm_embedding.weight", "mtp.norm.weight",
            "mtp.layers.0.self_attn.q_norm.weight", "mtp.layers.0.input_layernorm.weight"} <= names
    plain = {n for n in names if n.endswith(".weight") and len(pack.tensors[n].shape) == 2}
    assert plain == {"mtp.layers.0.mlp.gate.weight", "mtp.layers.0.mlp.shared_expert_gate.weight"}
    assert {pack.tensors[n].dtype for n in plain} == {"F16"}
    assert not any("embed_tokens" in n or "lm_head" in n for n in names)
    ledger = pack.sidecar["tensor_storage"]
    assert {t for m, e in ledger.items() if m.startswith("mtp.") for t in e["stored_tensors"]} == names


def test_drafts_follow_the_targets_last_prediction_and_the_layers_own_weights(packs):
    """The pass-through makes the layer draft mostly what the target predicted at the position before (accepted where
    the target repeats a token); the decoder layer's weights still decide some drafts: another seed's differ."""
    import transformers

    seq = [1] + torch.randint(3, 2048, (40,), generator=torch.Generator().manual_seed(5)).tolist()
    a, b = (mtp.draft_tokens(p, [seq])[0] for p in packs)
    assert len(a) == len(seq) - 1
    model = transformers.AutoModelForCausalLM.from_pretrained(mtp.decoded_checkpoint(packs[0], packs[0].parent / "d"),
                                                              dtype=torch.float32)
    with torch.no_grad():
        own = model(torch.tensor([seq])).logits[0].argmax(-1).tolist()  # the target's guess for token j + 1
    same = sum(x == y for x, y in zip(a, own)) / len(a)
    assert same > 0.5, same
    assert a != b
