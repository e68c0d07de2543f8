"""The model families the plugin serves, one module each (format/family.py says what a family is): `FAMILIES`,
and the lookups every gate uses."""

from __future__ import annotations

from ..architectures import Architecture
from ..family import Family
from . import dense, ernie45_moe, glm4_moe, glm4_moe_lite, gpt_oss, minimax_m2, mixtral, qwen3_moe, qwen3_next

FAMILIES: tuple[Family, ...] = (
    qwen3_moe.FAMILY, glm4_moe.FAMILY, mixtral.FAMILY, minimax_m2.FAMILY, ernie45_moe.FAMILY, gpt_oss.FAMILY,
    glm4_moe_lite.FAMILY, qwen3_next.QWEN3_NEXT, qwen3_next.QWEN3_5_MOE, *dense.FAMILIES)

_BY_ARCHITECTURE = {arch: family for family in FAMILIES for arch in family.architectures}
assert len(_BY_ARCHITECTURE) == sum(len(f.architectures) for f in FAMILIES), "an architecture in two families"

ARCHITECTURES: dict[str, Architecture] = {arch: f.architectures[arch] for arch, f in _BY_ARCHITECTURE.items()}


def family_of(architecture: str) -> Family | None:
    """The family whose tables cover `architecture` (a Hugging Face architecture name), None if none does."""
    return _BY_ARCHITECTURE.get(architecture)
