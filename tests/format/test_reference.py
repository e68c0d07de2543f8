"""The torch reference against ExLlamaV3's own outputs (golden fixtures) and against the spec's test vectors."""

from __future__ import annotations

import torch
from safetensors.torch import load_file

from vllm_exl3.format import reference as R
from vllm_exl3.format.constants import CODEBOOKS
from vllm_exl3.format.pack import Pack
from vllm_exl3.format.tensors import load_weights
from vllm_exl3.dev.synthetic import random_weights


def rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm()).item()


# ---------------------------------------------------------------------------------------------------------------
# golden outputs of ExLlamaV3 1.6.5
# ---------------------------------------------------------------------------------------------------------------
def test_rotated_weight_is_bit_exact(fixture_pack):
    pack = Pack.open(fixture_pack)
    golden = load_file(fixture_pack / "golden" / "recon_inner.safetensors")
    assert golden
    for name, expected in golden.items():
        w = load_weights(pack.linears()[name])
        got = R.decode_rotated(w.trellis, w.codebook)
        assert got.dtype == torch.float16 and got.shape == expected.shape, name
        assert torch.equal(got, expected), f"{name}: {(got != expected).sum()} elements differ"


def test_full_weight_matches(fixture_pack):
    pack = Pack.open(fixture_pack)
    golden = load_file(fixture_pack / "golden" / "recon_full.safetensors")
    assert golden
    for name, expected in golden.items():
        got = R.full_weight(load_weights(pack.linears()[name]))
        assert rel(got, expected) < 1e-3, name


def test_linear_forward_matches(fixture_pack):
    """y for 1/5/64 rows. ExLlamaV3 serves mul1 at <= 2 rows with its int8-activation GEMV, which itself
    deviates ~7e-3 from exact math (docs/format.md §5.4); everything else is held to 2e-3."""
    pack = Pack.open(fixture_pack)
    io = load_file(fixture_pack / "golden" / "linear_io.safetensors")
    checked = 0
    for key, x in io.items():
        prefix, sep, rows = key.rpartition(".x")
        if not sep:
            continue
        w = load_weights(pack.linears()[prefix])
        y = R.forward(x.float(), w)
        bound = 7.5e-3 if (w.codebook == "mul1" and int(rows) <= 2) else 2e-3
        assert rel(y, io[f"{prefix}.y{rows}"]) < bound, key
        checked += 1
    assert checked == 18  # 6 linears x rows 1/5/64


# ---------------------------------------------------------------------------------------------------------------
# spec test vectors (docs/format.md §1.5, §2.4)
# ---------------------------------------------------------------------------------------------------------------
def test_codebook_vectors():
    vectors = {
        "3inst": {0x0000: 0x3A25, 0x0001: 0xBB5B, 0x1234: 0xC066, 0xFFFF: 0xB110},
        "mcg": {0x0000: 0x3F60, 0x0001: 0x304E, 0x1234: 0x3E0F, 0xFFFF: 0x3ACD},
        "mul1": {0x0000: 0xC2E8, 0x0001: 0x3921, 0x1234: 0xB89E, 0xFFFF: 0xB936},
    }
    rms = {"3inst": 1.24371, "mcg": 1.24411, "mul1": 1.00031}
    for cb, table in vectors.items():
        lut = R.codebook_lut(cb)
        for state, bits in table.items():
            assert lut[state].view(torch.int16).item() & 0xFFFF == bits, (cb, hex(state))
        assert abs(lut.float().pow(2).mean().sqrt().item() - rms[cb]) < 1e-4


def _tile_from_words(words32: list[int], bits: float) -> torch.Tensor:
    """One tile's trellis: uint32 ring words stored as little-endian int16 pairs (§1.5 step 3)."""
    halves = []
    for w in words32:
        halves += [w & 0xFFFF, w >> 16]
    t = torch.tensor([h - 0x10000 if h >= 0x8000 else h for h in halves], dtype=torch.int16)
    assert t.numel() == round(bits * 16)
    return t.view(1, 1, -1)


def _states_by_position(trellis: torch.Tensor) -> list[int]:
    st = R.trellis_states(trellis)[0, 0]
    return [st[R.tile_position(t)].item() for t in range(256)]


def test_bitstream_vectors():
    # b=2, only ring bit 0 set: states t=0..7 walk the bit up to the MSB; all others 0.
    words = [0x80000000] + [0] * 15
    states = _states_by_position(_tile_from_words(words, 2))
    assert states[:8] == [0x0002, 0x0008, 0x0020, 0x0080, 0x0200, 0x0800, 0x2000, 0x8000]
    assert all(s == 0 for s in states[8:])
    # b=3, symbol_t = t mod 8 (tail-biting: state 0 takes its high bits from the end of the ring).
    words = [0x05397705, 0x39770539, 0x77053977] * 8
    tile = _tile_from_words(words, 3)
    assert tile.view(-1)[:4].tolist() == [0x7705, 0x0539, 0x0539, 0x3977]
    assert _states_by_position(tile)[:6] == [0xCBB8, 0x5DC1, 0xEE0A, 0x7053, 0x829C, 0x14E5]


def _naive_states(tile_words: list[int], bits: float) -> list[int]:
    """docs/format.md §1.5 taken literally, one ring bit at a time: an independent oracle."""
    w32 = [(tile_words[2 * j] & 0xFFFF) | ((tile_words[2 * j + 1] & 0xFFFF) << 16) for j in range(len(tile_words) // 2)]
    ring = 32 * len(w32)
    end, out = 0, []
    for width in R.symbol_widths(bits):
        end += width
        st = 0
        for p in range(end - 16, end):
            st = (st << 1) | ((w32[(p % ring) // 32] >> (31 - (p % ring) % 32)) & 1)
        out.append(st)
    return out


def test_vectorized_states_match_naive_decoder_for_every_bit_width():
    g = torch.Generator().manual_seed(1234)
    for bits in [1, 1.5, 2, 2.5, 3, 3.5, 4, 5, 6, 7, 8]:
        trellis = torch.randint(-(2**15), 2**15, (2, 3, round(bits * 16)), dtype=torch.int16, generator=g)
        for i in range(2):
            for j in range(3):
                got = _states_by_position(trellis[i:i + 1, j:j + 1].contiguous())
                assert got == _naive_states(trellis[i, j].tolist(), bits), (bits, i, j)


def test_decode_places_tiles_row_major_over_k_and_n():
    """Tile (i, j) of the trellis lands at rows 16i.., columns 16j.. of Ŵ, decoded independently."""
    w = random_weights(256, 384, 3, "mcg", seed=3)
    full = R.decode_rotated(w.trellis, "mcg")
    for i, j in [(0, 0), (5, 17), (15, 23)]:
        tile = R.decode_rotated(w.trellis[i:i + 1, j:j + 1].contiguous(), "mcg")
        assert torch.equal(full[16 * i:16 * i + 16, 16 * j:16 * j + 16], tile)


# ---------------------------------------------------------------------------------------------------------------
# rotations and forward
# ---------------------------------------------------------------------------------------------------------------
def test_hadamard_is_orthonormal_natural_order():
    h = R.hadamard_matrix().double()
    assert torch.allclose(h @ h, torch.eye(128, dtype=torch.float64), atol=1e-6)
    i, j = torch.meshgrid(torch.arange(128), torch.arange(128), indexing="ij")
    parity = torch.tensor([bin(v).count("1") % 2 for v in range(128)])[(i & j)]
    assert torch.equal(torch.sign(h), (1 - 2 * parity).double())


def test_forward_equals_x_times_full_weight_for_every_codebook_and_width():
    g = torch.Generator().manual_seed(7)
    for cb in CODEBOOKS:
        for bits in ([1, 2, 3, 4, 5, 6, 7, 8] + ([1.5, 2.5, 3.5] if cb == "mul1" else [])):
            w = random_weights(256, 384, bits, cb, seed=int(bits * 10))
            x = torch.randn(5, 256, generator=g)
            y = R.forward(x, w)
            expected = x.double() @ R.full_weight(w).double()
            assert rel(y, expected) < 1e-5, (cb, bits)


def test_forward_zero_extends_padded_inputs_and_trims_outputs():
    """in 320 -> padded 384: the padded rows of W are not zero, so x must be zero-extended (docs/format.md §5.1)."""
    w = random_weights(320, 200, 4, "mul1", seed=11)
    assert w.in_padded == 384 and w.out_padded == 256
    x = torch.randn(3, 320, dtype=torch.float64)
    y = R.forward(x, w, out_features=200)
    W = R.full_weight(w).double()
    assert y.shape == (3, 200)
    assert rel(y, x @ W[:320, :200]) < 1e-5
    assert R.full_weight(w)[320:].abs().sum() > 0  # the padded rows really are non-zero


def test_split_forward_with_block_halos_sums_to_the_whole():
    """Tensor-parallel slices that start inside a 128-block: row splits zero-fill their block, column splits
    compute the enclosing blocks and narrow. Partial outputs must sum (rows) / concatenate (columns) exactly."""
    w = random_weights(384, 384, 3, "mcg", seed=5)
    W_hat = R.decode_rotated(w.trellis, w.codebook)
    x = torch.randn(4, 384, dtype=torch.float64)
    whole = R.forward(x, w, W_hat)
    # row split at 192 (mid-block): rank 0 holds blocks 0-1 (rows 0..256), rank 1 blocks 1-2 (rows 128..384)
    from vllm_exl3.format.tensors import Exl3Weights

    def rows(a0, a1):
        return Exl3Weights(w.trellis[a0 // 16:a1 // 16], w.suh[a0:a1], w.svh, w.codebook, w.bits)

    part0 = R.forward(x[:, :192], rows(0, 256), in_offset=0)
    part1 = R.forward(x[:, 192:], rows(128, 384), in_offset=64)
    assert rel(part0 + part1, whole) < 1e-6
    # column split at 192: rank 1 computes columns 128..384 and keeps 64..256 of them
    cols1 = Exl3Weights(w.trellis[:, 8:24], w.suh, w.svh[128:384], w.codebook, w.bits)
    assert rel(R.forward(x, cols1, out_offset=64, out_features=192), whole[:, 192:]) < 1e-6


def test_reference_runs_on_cuda_when_present():
    import pytest

    if not torch.cuda.is_available():
        pytest.skip("no CUDA device")
    w = random_weights(256, 256, 4, "mul1", seed=1)
    on_gpu = R.decode_rotated(w.trellis.cuda(), w.codebook).cpu()
    assert torch.equal(on_gpu, R.decode_rotated(w.trellis, w.codebook))
