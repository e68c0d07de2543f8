"""An EXL3 linear that decodes to a chosen weight: each 16x16 tile's bitstream found by a Viterbi search over the
trellis (docs/format.md §1.4-§1.6), so a test pack can hold a linear of known function in the real format (random
tiles, dev/synthetic.py, give a valid linear of no particular function).

A tile is a ring of 256 symbols of `bits` bits; the weight at bitstream position t is the codebook's value of the 16
ring bits ending with symbol t, so it depends on that symbol and the 16 - bits bits before it. The search keeps, for
each of those 2^(16 - bits) histories, the least squared error of any symbol sequence ending in it; the ring closes
(tail-biting) by starting and ending in the same history, the one an unconstrained pass ends in with the least error.
No Hessian, no rounding feedback between tiles: each tile is matched on its own, which is all a test needs.

Integer bit widths (1-8) only; the half-integer rates (§1.8) vary the symbol width along the ring.
"""

from __future__ import annotations

import torch

from ..format import reference as R
from ..format.constants import INTEGER_BITS, STATE_BITS, TILE
from ..format.tensors import Exl3Weights

TILES_PER_PASS = 64  # bounds the back pointers: 256 x tiles x 2^(16 - bits) bytes


def _predecessors(bits: int) -> torch.Tensor:
    """[2^bits, 2^(16 - bits)]: for each history g after a symbol, the histories it can follow (they differ in their
    top `bits` bits, which the symbol shifts out)."""
    history = STATE_BITS - bits
    g = torch.arange(1 << history)
    return (torch.arange(1 << bits)[:, None] << (history - bits)) | (g[None, :] >> bits)


def _search(targets: torch.Tensor, values: torch.Tensor, prev: torch.Tensor, start: torch.Tensor | None):
    """(least error, back pointers) of every symbol sequence for `targets` [T, 256]: `values` [2^bits, H] is the
    weight a step into history g from its p-th predecessor decodes to; `start` fixes each tile's first history."""
    n = prev.shape[1]
    cost = torch.zeros(targets.shape[0], n)
    if start is not None:
        cost = torch.full_like(cost, float("inf"))
        cost[torch.arange(len(start)), start] = 0
    back = torch.empty(TILE * TILE, targets.shape[0], n, dtype=torch.uint8)
    for t in range(TILE * TILE):
        cost, back[t] = (cost[:, prev] + (values[None] - targets[:, t, None, None]) ** 2).min(1)
    return cost, back


def encode_tiles(targets: torch.Tensor, bits: int, codebook: str) -> tuple[torch.Tensor, torch.Tensor]:
    """(symbols [T, 256] in ring order, mean squared error [T]) of the bitstreams closest to `targets` [T, 256] (the
    tiles' weights in bitstream order)."""
    prev = _predecessors(bits)
    mask = (1 << bits) - 1
    values = R.codebook_lut(codebook).float()[(prev << bits) | (torch.arange(prev.shape[1]) & mask)[None, :]]
    end, _ = _search(targets, values, prev, None)
    ring = end.argmin(1)  # the history the ring closes on
    cost, back = _search(targets, values, prev, ring)
    rows = torch.arange(targets.shape[0])
    symbols = torch.empty(targets.shape, dtype=torch.int64)
    g = ring.clone()
    for t in range(TILE * TILE - 1, -1, -1):
        symbols[:, t] = g & mask
        g = prev[back[t, rows, g].long(), g]
    return symbols, cost[rows, ring] / (TILE * TILE)


def trellis_words(symbols: torch.Tensor, bits: int) -> torch.Tensor:
    """Symbols [T, 256] -> int16 words [T, 16 * bits]: the ring's bits most significant first in 32-bit words, each
    stored as two little-endian int16 (format/reference.py trellis_states reads them so)."""
    t = symbols.shape[0]
    ring = ((symbols[:, :, None] >> torch.arange(bits - 1, -1, -1)) & 1).reshape(t, -1, 32)
    u32 = (ring << torch.arange(31, -1, -1)).sum(-1)
    words = torch.stack([u32 & 0xFFFF, u32 >> 16], -1).reshape(t, -1)
    return torch.where(words >= 0x8000, words - 0x10000, words).to(torch.int16)


def encoded_weights(weight: torch.Tensor, bits: int, codebook: str, suh: torch.Tensor,
                    svh: torch.Tensor) -> Exl3Weights:
    """An EXL3 linear with these `suh` / `svh` (fp16) whose full weight (format/reference.py full_weight: diag(suh) ·
    H · Ŵ · H · diag(svh)) is close to `weight` [in, out] (both dims multiples of 128, as stored). Rows where suh is 0
    and columns where svh is 0 decode to exactly 0 whatever the tiles hold: `weight` must be 0 there."""
    if bits not in INTEGER_BITS:
        raise ValueError(f"bits must be an integer 1-8, got {bits}")
    bits, k, n = int(bits), *weight.shape
    su, sv = suh.half().float(), svh.half().float()  # as stored
    if weight[su == 0].any() or weight[:, sv == 0].any():
        raise ValueError("weight must be 0 in the rows where suh is 0 and the columns where svh is 0")
    inv_u = torch.where(su == 0, 0.0, 1 / su)
    inv_v = torch.where(sv == 0, 0.0, 1 / sv)
    w_hat = R.hadamard_rows(R.hadamard_cols(weight.float() * inv_u[:, None] * inv_v[None, :]))  # H (W / su sv) H
    positions = [R.tile_position(t) for t in range(TILE * TILE)]
    r, c = torch.tensor([p[0] for p in positions]), torch.tensor([p[1] for p in positions])
    tiles = w_hat.reshape(k // TILE, TILE, n // TILE, TILE).permute(0, 2, 1, 3)[..., r, c]
    tiles = tiles.reshape(-1, TILE * TILE)  # [tile, bitstream position]
    unique, which = torch.unique(tiles, dim=0, return_inverse=True)  # a structured weight repeats its tiles
    symbols = torch.cat([encode_tiles(unique[i:i + TILES_PER_PASS], bits, codebook)[0]
                         for i in range(0, len(unique), TILES_PER_PASS)])
    trellis = trellis_words(symbols, bits)[which].reshape(k // TILE, n // TILE, TILE * bits)
    return Exl3Weights(trellis, suh.half(), svh.half(), codebook, float(bits))
