"""Tensor bytes into torch: one record as a CPU tensor, one linear's weights in memory, the check of a tensor handed
to a layer against its header (torch imported on first use)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from .constants import TILE
from .errors import Exl3FormatError
from .headers import DTYPES, TensorRecord, read_bytes
from .records import Exl3Linear, TrellisGeometry

if TYPE_CHECKING:
    from .index import LinearMeta


def read_tensor(rec: TensorRecord):
    """A torch tensor (CPU, owning its memory) with the record's dtype and shape."""
    import torch

    dtype = TORCH_DTYPES[rec.dtype]
    buf = bytearray(read_bytes(rec))
    if not buf:
        return torch.empty(rec.storage_shape, dtype=dtype)
    return torch.frombuffer(buf, dtype=torch.uint8).view(dtype).reshape(rec.storage_shape)


class _TorchDtypes(dict):
    """safetensors dtype name -> torch dtype (headers.DTYPES, the one table), resolved on first use so this module
    imports without torch. A dtype this torch build lacks is a KeyError."""

    def __missing__(self, key: str):
        import torch

        spec = DTYPES.get(key)
        dtype = getattr(torch, spec.torch_name, None) if spec else None
        if dtype is None:
            raise KeyError(f"safetensors dtype {key} has no torch equivalent in torch {torch.__version__}")
        self[key] = dtype
        return dtype


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


def check_delivered(meta: LinearMeta, prefix: str, suffix: str, tensor) -> None:
    """The tensor a checkpoint loader hands a layer for `<prefix>.<suffix>` has the dtype and shape the pack's header
    gave it (`LinearMeta.stored`); Exl3FormatError naming the tensor otherwise."""
    try:
        dtype_name, shape = meta.stored(suffix)
    except KeyError:
        raise Exl3FormatError(None, f"{prefix}.{suffix}", f"one of {', '.join(sorted(meta.suffixes))} for this linear",
                              "a tensor it does not have") from None
    dtype = TORCH_DTYPES[dtype_name]
    if tuple(tensor.shape) != shape or tensor.dtype != dtype:
        raise Exl3FormatError(None, f"{prefix}.{suffix}", f"{dtype}{list(shape)} as the pack header said",
                              f"{tensor.dtype}{list(tensor.shape)}")
