"""What vLLM 0.31-0.33 needs per model family beyond the tables of format/families/: the module prefixes its model
classes build layers under where those differ from the checkpoint's names (the quantization config finds a layer's
pack tensors by the prefix vLLM hands it)."""

from __future__ import annotations

from collections.abc import Mapping

from ..format.index import PackIndex

# architecture -> (checkpoint name part, the part vLLM's prefix has instead). vLLM's MiniMaxM2DecoderLayer holds its
# MoE as `block_sparse_moe` (the checkpoint's name, which its loader follows) but builds it with the prefix `.mlp`.
PREFIX_RENAMES: Mapping[str, tuple[tuple[str, str], ...]] = {
    "MiniMaxM2ForCausalLM": ((".block_sparse_moe.", ".mlp."),),
}


class _Renamer:
    def __init__(self, renames: tuple[tuple[str, str], ...]):
        self.renames = renames

    def map_name(self, name: str) -> str:
        for old, new in self.renames:
            name = name.replace(old, new)
        return name


def under_vllm_prefixes(index: PackIndex, architecture: str) -> PackIndex:
    """`index` under the prefixes vLLM builds `architecture`'s layers with."""
    renames = PREFIX_RENAMES.get(architecture)
    return index.renamed(_Renamer(renames)) if renames else index
