"""The oracle: EXL3 decode, Hadamard rotations and the linear forward in plain PyTorch (CPU or CUDA).

Written from docs/format.md (§1.4-§1.8 bit layout, §2 codebooks, §3 rotations). `decode_rotated` reproduces
ExLlamaV3's reconstruct kernel bit for bit; everything else is fp32 math and therefore tolerance-compatible
with ExLlamaV3 (whose own paths differ from each other in rounding, §3.3).

All work is vectorized: one gather per 16-bit state, one table lookup per weight, no Python loop over tiles.
"""

from __future__ import annotations

import functools
import math
import sys

import torch

from .constants import (CODEBOOK_3INST, CODEBOOK_MCG, CODEBOOK_MUL1, HADAMARD_BLOCK, HALF_PAIR_MASK,  # noqa: F401
                        HALF_PAIR_XOR, INST3_ADD, INST3_MUL, MARKER_VALUE, MUL1_BIAS, MUL1_BYTE_SUM_BASE,
                        MUL1_INV_SCALE, STATE_BITS, TILE)
from .records import bits_from_trellis_dim
from .tensors import Exl3Weights

if sys.byteorder != "little":  # the int16 pairs of a trellis word are little-endian uint32 (§1.5 step 3)
    raise ImportError("vllm_exl3.format.reference assumes a little-endian host")

# The codebooks' numbers (§2.1-§2.3) are format/constants.py's.
TILE_WEIGHTS = TILE * TILE
U32 = 0xFFFFFFFF
_DECODE_CHUNK_STATES = 1 << 22  # states decoded per step; bounds the int64 temporaries to ~32 MB


def _fp16_from_bits(bits16: torch.Tensor) -> torch.Tensor:
    """Reinterpret integers in [0, 65536) as IEEE binary16."""
    signed = torch.where(bits16 >= 0x8000, bits16 - 0x10000, bits16)
    return signed.to(torch.int16).view(torch.float16)


@functools.lru_cache(maxsize=None)
def _codebook_lut_cpu(codebook: str) -> torch.Tensor:
    state = torch.arange(1 << STATE_BITS, dtype=torch.int64)
    if codebook == CODEBOOK_MUL1:
        y = (state * MARKER_VALUE[CODEBOOK_MUL1]) & U32
        byte_sum = (y & 0xFF) + ((y >> 8) & 0xFF) + ((y >> 16) & 0xFF) + (y >> 24)
        # Every intermediate is exact in fp32 (§2.3), so this is a single rounding, like the hardware __hfma.
        return ((byte_sum + MUL1_BYTE_SUM_BASE).to(torch.float32) * MUL1_INV_SCALE + MUL1_BIAS).to(torch.float16)
    if codebook == CODEBOOK_MCG:
        y = (state * MARKER_VALUE[CODEBOOK_MCG]) & U32
    elif codebook == CODEBOOK_3INST:
        y = (state * INST3_MUL + INST3_ADD) & U32
    else:
        raise ValueError(f"unknown EXL3 codebook {codebook!r}")
    y = (y & HALF_PAIR_MASK) ^ HALF_PAIR_XOR
    lo, hi = _fp16_from_bits(y & 0xFFFF), _fp16_from_bits(y >> 16)
    # Both halves lie in [0.125, 2): their exact sum fits fp32, so this equals the hardware __hadd (§2.2).
    return (lo.to(torch.float32) + hi.to(torch.float32)).to(torch.float16)


def codebook_lut(codebook: str, device: torch.device | str = "cpu") -> torch.Tensor:
    """fp16 value of every 16-bit trellis state, [65536]."""
    return _cached_on_device(_codebook_lut_cpu, codebook, torch.device(device))


def symbol_widths(bits: float) -> list[int]:
    """Bits carried by each of the 256 positions of a tile (§1.5; §1.8 for half-integer rates)."""
    if bits == int(bits):
        return [int(bits)] * TILE_WEIGHTS
    base = int(bits)
    return [base + ((0xAAAA >> (i % 16)) & 1) for i in range(TILE_WEIGHTS)]


def tile_position(t: int) -> tuple[int, int]:
    """Bitstream position -> (row k, column n) inside a 16x16 tile: mma.m16n8k16 B-fragment order (§1.4)."""
    lane, j = t >> 3, t & 7
    return 2 * (lane & 3) + (j & 1) + 8 * ((j >> 1) & 1), (lane >> 2) + 8 * ((j >> 2) & 1)


@functools.lru_cache(maxsize=None)
def _state_tables_cpu(words_per_tile: int) -> tuple[torch.Tensor, torch.Tensor]:
    """For each tile element in row-major (k, n) order: the 32-bit word its state window starts in, and the
    right shift that extracts the window from the 48-bit value (word << 16) | (next word >> 16)."""
    bits = bits_from_trellis_dim(words_per_tile)
    assert bits is not None, words_per_tile
    ring_bits = words_per_tile * 16
    word_index = [0] * TILE_WEIGHTS
    shift = [0] * TILE_WEIGHTS
    end = 0
    for t, width in enumerate(symbol_widths(bits)):
        end += width  # the state of position t is the 16 ring bits ending here (tail-biting ring)
        start = (end - STATE_BITS) % ring_bits
        r, c = tile_position(t)
        word_index[r * TILE + c] = start // 32
        shift[r * TILE + c] = 32 - start % 32
    assert end == ring_bits
    return torch.tensor(word_index, dtype=torch.int64), torch.tensor(shift, dtype=torch.int64)


def _cached_on_device(fn, key, device: torch.device):
    cpu_value = fn(key)
    if device.type == "cpu":
        return cpu_value
    cache = _cached_on_device.__dict__.setdefault("cache", {})
    k = (fn.__name__, key, device)
    if k not in cache:
        cache[k] = tuple(v.to(device) for v in cpu_value) if isinstance(cpu_value, tuple) else cpu_value.to(device)
    return cache[k]


def trellis_states(trellis: torch.Tensor) -> torch.Tensor:
    """16-bit state of every weight, int64 [K/16, N/16, 16, 16] in row-major tile order."""
    kt, nt, words = trellis.shape
    word_index, shift = _cached_on_device(_state_tables_cpu, words, trellis.device)
    u32 = trellis.reshape(kt * nt, words).contiguous().view(torch.int32).to(torch.int64) & U32
    pair = (u32 << 16) | (torch.roll(u32, -1, dims=1) >> 16)  # ring wraps: last word pairs with the first
    return ((pair[:, word_index] >> shift) & 0xFFFF).view(kt, nt, TILE, TILE)


def decode_rotated(trellis: torch.Tensor, codebook: str) -> torch.Tensor:
    """Ŵ, the rotated-basis weight (fp16, (in, out) = (16·K/16, 16·N/16)); bit-exact with ExLlamaV3."""
    if trellis.dtype != torch.int16 or trellis.dim() != 3:
        raise ValueError(f"trellis must be int16 [K/16, N/16, 16*bits], got {trellis.dtype} {list(trellis.shape)}")
    kt, nt, _ = trellis.shape
    lut = codebook_lut(codebook, trellis.device)
    out = torch.empty(kt, TILE, nt, TILE, dtype=torch.float16, device=trellis.device)
    rows_per_step = max(1, _DECODE_CHUNK_STATES // (nt * TILE_WEIGHTS))
    for k0 in range(0, kt, rows_per_step):
        k1 = min(kt, k0 + rows_per_step)
        values = lut[trellis_states(trellis[k0:k1])]  # [rows, nt, 16, 16]
        out[k0:k1] = values.permute(0, 2, 1, 3)
    return out.view(kt * TILE, nt * TILE)


@functools.lru_cache(maxsize=None)
def _hadamard_cpu(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:  # Sylvester doubling gives the natural-order matrix H[i][j] = (-1)^popcount(i & j)
        h = torch.cat([torch.cat([h, h], 1), torch.cat([h, -h], 1)], 0)
    return (h / math.sqrt(n)).to(torch.float32)


def hadamard_matrix(device: torch.device | str = "cpu") -> torch.Tensor:
    """The normalized 128x128 Hadamard block (symmetric, orthonormal), fp32."""
    return _cached_on_device(_hadamard_cpu, HADAMARD_BLOCK, torch.device(device))


def hadamard_rows(x: torch.Tensor) -> torch.Tensor:
    """Apply the block-diagonal Hadamard to the last dim (independently per 128-element block), in fp32."""
    h = hadamard_matrix(x.device)
    shape = x.shape
    return (x.reshape(*shape[:-1], shape[-1] // HADAMARD_BLOCK, HADAMARD_BLOCK).float() @ h).reshape(shape)


def hadamard_cols(w: torch.Tensor) -> torch.Tensor:
    """Apply the block-diagonal Hadamard down the first dim of a (K, N) matrix, in fp32."""
    k, n = w.shape
    return (hadamard_matrix(w.device) @ w.reshape(k // HADAMARD_BLOCK, HADAMARD_BLOCK, n).float()).reshape(k, n)


def full_weight(w: Exl3Weights, w_hat: torch.Tensor | None = None) -> torch.Tensor:
    """W = diag(suh) · H · Ŵ · H · diag(svh), fp32, (in, out) padded geometry (§3.2)."""
    if w_hat is None:
        w_hat = decode_rotated(w.trellis, w.codebook)
    wf = hadamard_cols(w_hat.float()) * w.suh.float().unsqueeze(1)
    return hadamard_rows(wf) * w.svh.float()


def zero_extend(x: torch.Tensor, width: int, offset: int, dtype: torch.dtype | None = None) -> torch.Tensor:
    """x [M, w] at columns [offset, offset + w) of a zero [M, width] input (x's dtype unless given): the padded
    rows of W are not zero (docs/format.md §5.1), so every input column outside x must be an explicit zero."""
    if offset < 0 or offset + x.shape[-1] > width:
        raise ValueError(f"input of width {x.shape[-1]} at offset {offset} does not fit the padded width {width}")
    out = x.new_zeros((x.shape[0], width), dtype=dtype or x.dtype)
    out[:, offset:offset + x.shape[-1]] = x
    return out


def rotated_forward(x: torch.Tensor, suh: torch.Tensor, svh: torch.Tensor, w_hat: torch.Tensor, in_offset: int,
                    out_offset: int, out_features: int, in_weight_dtype: bool = False) -> torch.Tensor:
    """The zero-extend-and-rotate forward through Ŵ (§3.3): x [M, in] zero-extended at in_offset, H(x · suh),
    times Ŵ, H(·) · svh, output columns [out_offset, out_offset + out_features); fp32 result. The product is fp32,
    or with `in_weight_dtype` in Ŵ's own dtype (the torch backend's fp16 Ŵ on CUDA, fp32 accumulation)."""
    xh = hadamard_rows(zero_extend(x, w_hat.shape[0], in_offset, torch.float32) * suh.float())
    z = (xh.to(w_hat.dtype) @ w_hat).float() if in_weight_dtype else xh @ w_hat.float()
    return (hadamard_rows(z) * svh.float())[:, out_offset:out_offset + out_features]


def forward(
    x: torch.Tensor,
    w: Exl3Weights,
    w_hat: torch.Tensor | None = None,
    in_offset: int = 0,
    out_offset: int = 0,
    out_features: int | None = None,
    add_bias: bool = True,
) -> torch.Tensor:
    """y = x · W (+ bias) in fp32, returned in x's dtype.

    `x` ([..., in]) is placed at columns [in_offset, in_offset + in) of a zero input of the padded width: the
    padded rows of W are not zero (docs/format.md §5.1), and a tensor-parallel rank whose slice starts inside a
    128-block zero-fills the rest of the block. The output is columns [out_offset, out_offset + out_features).
    `w_hat` may be a cached Ŵ (any float dtype); the whole computation is fp32.
    """
    if w_hat is None:
        w_hat = decode_rotated(w.trellis, w.codebook)
    lead, width = x.shape[:-1], x.shape[-1]
    out_features = w_hat.shape[1] - out_offset if out_features is None else out_features
    y = rotated_forward(x.reshape(-1, width), w.suh, w.svh, w_hat, in_offset, out_offset, out_features)
    if add_bias and w.bias is not None:
        y = y + w.bias.float()[out_offset:out_offset + out_features]
    return y.to(x.dtype).reshape(*lead, out_features)
