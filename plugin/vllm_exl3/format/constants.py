"""The numbers and names that define an EXL3 pack (docs/format.md), each named once (header-only: no torch)."""

from __future__ import annotations

# --- docs/format.md §1.1 / §1.7: codebook markers ------------------------------------------------------------
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
STATE_BITS = 16  # §1.5: every weight is decoded from a 16-bit window of the tile's bitstream

# --- §2: decode constants of the codebooks (state -> fp16 value) ----------------------------------------------
INST3_MUL, INST3_ADD = 89226354, 64248484  # §2.1 3INST: y = state * mul + add (mod 2^32)
HALF_PAIR_MASK, HALF_PAIR_XOR = 0x8FFF8FFF, 0x3B603B60  # §2.1/§2.2: (y & mask) ^ xor = two fp16 halves, summed
# §2.3 MUL1: y = state * marker, value = fp16((byte sum of y + 1024) * 887/131072 - 1329/128), rounded once
MUL1_INV_SCALE = 887 / 131072  # fp16 0x1EEE
MUL1_BIAS = -1329 / 128  # fp16 0xC931
MUL1_BYTE_SUM_BASE = 1024  # the kernels' dp4a accumulator starts at fp16 0x6400 = 1024.0
MUL1_BYTE_SUM_BASE_FP16 = 0x6400

# The one table of those numbers as csrc/exl3_decode.cuh (and exl3_kernels.h) name them; the kernels' copies are
# checked against it by tests/kernels/csrc/test_csrc_build.py (host-compiled tests/kernels/csrc/constants_host.cpp).
CSRC_DECODE_CONSTANTS = {
    "kTile": TILE,
    "kHadBlock": HADAMARD_BLOCK,
    "kStateBits": STATE_BITS,
    "k3InstMul": INST3_MUL,
    "k3InstAdd": INST3_ADD,
    "kMcgMul": MARKER_VALUE[CODEBOOK_MCG],
    "kMul1Mul": MARKER_VALUE[CODEBOOK_MUL1],
    "kHalfPairMask": HALF_PAIR_MASK,
    "kHalfPairXor": HALF_PAIR_XOR,
    "kMul1Base": MUL1_BYTE_SUM_BASE_FP16,
    "kMul1InvScale": MUL1_INV_SCALE,
    "kMul1Bias": MUL1_BIAS,
    # the C++ codebook index of each name (exl3_kernels.h `enum Codebook`): its position in CODEBOOKS
    "kCb3Inst": CODEBOOKS.index(CODEBOOK_3INST),
    "kCbMcg": CODEBOOKS.index(CODEBOOK_MCG),
    "kCbMul1": CODEBOOKS.index(CODEBOOK_MUL1),
}

# --- §1.6 / §1.8: valid bit widths ----------------------------------------------------------------------------
INTEGER_BITS = range(1, 9)
HALF_INTEGER_BASES = (1, 2, 3)  # 1.5 / 2.5 / 3.5, mul1 only

# Tensor suffixes that belong to an EXL3 linear (the `.weight` is replaced by these).
EXL3_SUFFIXES = ("trellis", "suh", "svh", "su", "sv", "mcg", "mul1", "bias")

INDEX_FILE = "model.safetensors.index.json"
SIDECAR_FILE = "quantization_config.json"
