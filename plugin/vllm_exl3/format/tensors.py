"""Tensor bytes into torch: one record as a CPU tensor, one linear's weights in memory (torch imported on first use)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from .constants import TILE
from .headers import TensorRecord, read_bytes
from .records import Exl3Linear, TrellisGeometry


def read_tensor(rec: TensorRecord):
    """A torch tensor (CPU, owning its memory) with the record's dtype and shape."""
    import torch

    dtype = TORCH_DTYPES[rec.dtype]
    buf = bytearray(read_bytes(rec))
    if not buf:
        return torch.empty(rec.shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=dtype).reshape(rec.shape)


class _TorchDtypes(dict):
    """safetensors dtype name -> torch dtype, resolved on first use so this module imports without torch."""

    def __missing__(self, key: str):
        import torch

        table = {"F16": torch.float16, "BF16": torch.bfloat16, "F32": torch.float32, "F64": torch.float64,
                 "I8": torch.int8, "U8": torch.uint8, "I16": torch.int16, "I32": torch.int32, "I64": torch.int64,
                 "BOOL": torch.bool, "U16": torch.uint16, "U32": torch.uint32, "U64": torch.uint64,
                 "F8_E4M3": torch.float8_e4m3fn, "F8_E5M2": torch.float8_e5m2}
        if key not in table:
            raise KeyError(f"safetensors dtype {key} has no torch equivalent")
        self.update(table)
        return table[key]


TORCH_DTYPES = _TorchDtypes()


@dataclass
class Exl3Weights(TrellisGeometry):
    """One linear's tensors in memory (legacy sign bitfields already expanded to suh/svh)."""

    trellis: Any  # int16 [K/16, N/16, 16*bits]
    suh: Any  # fp16 [K]
    svh: Any  # fp16 [N]
    codebook: str
    bits: float
    bias: Any = None


def unpack_signs(words):
    """Legacy `.su`/`.sv` (§1.1): bit i of int16 word w set means element 16*w+i is -1, else +1."""
    import torch

    bits = (words.to(torch.int32).unsqueeze(-1) >> torch.arange(TILE, dtype=torch.int32)) & 1
    return (1 - 2 * bits).reshape(-1).to(torch.float16)


def load_weights(linear: Exl3Linear) -> Exl3Weights:
    suh = read_tensor(linear.suh) if linear.suh else unpack_signs(read_tensor(linear.su))
    svh = read_tensor(linear.svh) if linear.svh else unpack_signs(read_tensor(linear.sv))
    bias = read_tensor(linear.bias) if linear.bias else None
    return Exl3Weights(read_tensor(linear.trellis), suh, svh, linear.codebook, linear.bits, bias)
