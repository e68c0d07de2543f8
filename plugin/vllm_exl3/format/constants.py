"""The numbers and names that define an EXL3 pack (docs/format.md), each named once (header-only: no torch)."""

from __future__ import annotations

# --- exl3-format.md §1.1 / §1.7: codebook markers ------------------------------------------------------------
# A 0-dim int32 tensor `<prefix>.mcg` or `<prefix>.mul1` selects the codebook; no marker means 3INST. The stored
# value is the codebook's multiplier reinterpreted as int32; ExLlamaV3 >= 1.6 refuses any other value, so do we.
CODEBOOK_3INST = "3inst"
CODEBOOK_MCG = "mcg"
CODEBOOK_MUL1 = "mul1"
CODEBOOKS = (CODEBOOK_3INST, CODEBOOK_MCG, CODEBOOK_MUL1)
MARKER_VALUE = {CODEBOOK_MCG: 0xCBAC1FED, CODEBOOK_MUL1: 0x83DCD12D}  # as uint32

# --- §1.2: both feature dims are padded to the Hadamard block -------------------------------------------------
HADAMARD_BLOCK = 128
TILE = 16  # §1.3: 16x16 tiles

# --- §1.6 / §1.8: valid bit widths ----------------------------------------------------------------------------
INTEGER_BITS = range(1, 9)
HALF_INTEGER_BASES = (1, 2, 3)  # 1.5 / 2.5 / 3.5, mul1 only

# Tensor suffixes that belong to an EXL3 linear (the `.weight` is replaced by these).
EXL3_SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias")

INDEX_FILE = "model.safetensors.index.json"
SIDECAR_FILE = "quantization_config.json"
