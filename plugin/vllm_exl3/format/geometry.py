"""Which part of a stored EXL3 weight one tensor-parallel rank keeps, and how its input/output line up.

The Hadamard rotations work on 128-element blocks of both feature dims, so a rank cannot compute a slice that
starts inside a block from that slice's tiles alone. It keeps the enclosing 128-aligned block range instead:

- input side (row-parallel split, or logical < padded width): the rank's x lands at `in_offset` inside a zero
  input of the block range's width. The zero entries contribute nothing, so the per-rank partial products
  still sum to x·W exactly.
- output side (column-parallel split, trimming padded outputs): the rank computes the block range's outputs and
  keeps `out_features` of them starting at `out_offset`.

Splits on 128 boundaries cost nothing; others cost at most one extra block per side (logged once per layer).
This is also how padding is handled (docs/format.md §5.1: padded rows of W are not zero, so x must be
zero-extended, never W truncated).
"""

from __future__ import annotations

from dataclasses import dataclass

from .constants import HADAMARD_BLOCK, TILE


def ceil_to(n: int, multiple: int = HADAMARD_BLOCK) -> int:
    """n rounded up to a multiple (by default the Hadamard block both feature dims are padded to): the ONE rounding
    rule (padding, the reader's alignment, huge-page boundaries)."""
    return -(-n // multiple) * multiple


@dataclass(frozen=True)
class Span:
    """A rank's logical range [start, stop) of one feature dim, and the stored block range around it."""

    start: int
    stop: int
    block_start: int
    block_stop: int

    @classmethod
    def around(cls, start: int, stop: int, padded: int) -> "Span":
        if not 0 <= start <= stop <= padded:
            raise ValueError(f"range [{start}, {stop}) outside the padded width {padded}")
        b0 = start // HADAMARD_BLOCK * HADAMARD_BLOCK
        b1 = min(ceil_to(stop), padded)
        return cls(start, stop, b0, b1)

    @property
    def offset(self) -> int:
        return self.start - self.block_start

    @property
    def size(self) -> int:
        return self.stop - self.start

    @property
    def block_size(self) -> int:
        return self.block_stop - self.block_start

    @property
    def tiles(self) -> slice:
        return slice(self.block_start // TILE, self.block_stop // TILE)

    @property
    def elements(self) -> slice:
        return slice(self.block_start, self.block_stop)

    def splits_a_block(self, total: int) -> bool:
        """True when the slice starts or (before the logical end `total`) stops inside a 128-block."""
        return self.start % HADAMARD_BLOCK != 0 or (self.stop != total and self.stop % HADAMARD_BLOCK != 0)


def check_padding(what: str, logical: int, padded: int) -> None:
    """The pack's padded width must be exactly the model's width rounded up to a Hadamard block."""
    if ceil_to(logical) != padded:
        raise ValueError(f"{what}: the pack stores {padded} padded features but the model config gives "
                         f"{logical} (which pads to {ceil_to(logical)}): the pack does not match this model")
