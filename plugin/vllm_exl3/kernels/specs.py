"""What a layer asks of a backend: `LinearSpec`, `MoESpec`, and a routed-experts layer's weights (`ExpertStack`).
Names, not indices, cross this boundary: codebooks and activations are strings, projections are `PROJECTIONS`."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ..format.tensors import Exl3Weights


@dataclass(frozen=True)
class LinearSpec:
    """What a backend needs to know to accept or refuse a dense EXL3 linear."""

    codebook: str
    bits: float
    in_padded: int  # K of the stored (block-aligned) slice
    out_padded: int  # N of the stored slice
    act_dtype: torch.dtype
    device_type: str


@dataclass(frozen=True)
class MoESpec:
    """What a backend needs to know to accept or refuse a routed-experts layer."""

    codebooks: tuple[str, ...]
    bits: tuple[float, ...]
    hidden_padded: int
    intermediate_padded: int
    num_local_experts: int
    activation: str
    act_dtype: torch.dtype
    device_type: str
    has_bias: bool = False  # the experts' projections add biases (ExpertStack.w13_bias / w2_bias)


# The experts' gated activations: act(gate) * up, and gpt-oss's clamped SwiGLU (MoECall.limit, MoECall.alpha):
# min(gate, limit) * sigmoid(alpha * min(gate, limit)) * (clamp(up, -limit, limit) + 1).
ACTIVATIONS = ("silu", "gelu", "gelu_tanh", "swigluoai")
SWIGLUOAI_ALPHA, SWIGLUOAI_LIMIT = 1.702, 7.0  # gpt-oss's (vLLM's SwigluOAIAndMul defaults, which its model uses)
PROJECTIONS = ("gate", "up", "down")  # of one expert, in this order wherever per-projection values are listed
W13 = ("gate", "up")  # share the input (hidden); stacked on dim 1 of ExpertStack.w13_*, in this order
W2 = "down"  # ExpertStack.w2_*: input intermediate, output hidden


@dataclass
class ExpertStack:
    """A routed-experts layer's EXL3 weights as one rank stores them.

    gate/up share the input (hidden) and are stacked on dim 1; every tile record is padded to the widest bit
    width in the stack (`*_words` say how many int16 words each (expert, projection) really uses). Intermediate
    features follow the same block-range rule as dense layers (geometry.py): gate/up outputs are computed for
    the stored block range and narrowed at `inter_offset`; the down projection's input is zero-filled there.
    """

    w13_trellis: torch.Tensor  # int16 [E, 2, H/16, I_blk/16, W13]
    w13_suh: torch.Tensor  # fp16 [E, 2, H]
    w13_svh: torch.Tensor  # fp16 [E, 2, I_blk]
    w2_trellis: torch.Tensor  # int16 [E, I_blk/16, H/16, W2]
    w2_suh: torch.Tensor  # fp16 [E, I_blk]
    w2_svh: torch.Tensor  # fp16 [E, H]
    w13_words: tuple[int, ...]  # [E * 2]
    w2_words: tuple[int, ...]  # [E]
    codebooks: tuple[str, ...]  # [E * 3]: gate, up, down of each expert
    inter_offset: int
    inter_size: int
    w13_bias: torch.Tensor | None = None  # fp32 [E, 2, I_blk], zero outside the slice; None: no biases
    w2_bias: torch.Tensor | None = None  # fp32 [E, H] (zero on all tensor-parallel ranks but the first)

    @property
    def has_bias(self) -> bool:
        return self.w13_bias is not None

    @property
    def num_experts(self) -> int:
        return self.w13_trellis.shape[0]

    def codebook(self, expert: int, proj: str) -> str:
        """The codebook of one projection of one local expert."""
        return self.codebooks[len(PROJECTIONS) * expert + PROJECTIONS.index(_checked(proj))]

    def words(self, expert: int, proj: str) -> int:
        """The int16 words per tile record one projection of one local expert really uses."""
        if _checked(proj) == W2:  # the stack's own layout: gate, up in w13; down in w2
            return self.w2_words[expert]
        return self.w13_words[len(W13) * expert + W13.index(proj)]

    def weights(self, expert: int, proj: str) -> Exl3Weights:
        """Views of one projection ("gate", "up" or "down": PROJECTIONS) of one local expert."""
        from ..format.records import bits_from_trellis_dim

        words, codebook = self.words(expert, proj), self.codebook(expert, proj)
        if proj in W13:
            i = W13.index(proj)
            t, suh, svh = self.w13_trellis[expert, i], self.w13_suh[expert, i], self.w13_svh[expert, i]
        else:
            t, suh, svh = self.w2_trellis[expert], self.w2_suh[expert], self.w2_svh[expert]
        return Exl3Weights(t[..., :words], suh, svh, codebook, bits_from_trellis_dim(words))


def _checked(proj: str) -> str:
    if proj not in PROJECTIONS:
        raise ValueError(f"unknown expert projection {proj!r} (expected one of {', '.join(PROJECTIONS)})")
    return proj
