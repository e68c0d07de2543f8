"""What a pack holds, as plain data: the summary behind `vllm-exl3 inspect` (and the memory planner)."""

from __future__ import annotations

from collections import Counter
from dataclasses import asdict, dataclass, field
from typing import Any

from .pack import Pack, tensor_group
from .records import format_bits

GROUPS = ("experts", "dense", "head")


@dataclass
class GroupStats:
    tensors: int = 0
    bytes: int = 0
    weights: int = 0  # stored (padded) weights

    @property
    def bits_per_weight(self) -> float:
        return 8 * self.bytes / self.weights if self.weights else 0.0


@dataclass
class Support:
    """Whether the plugin serves a pack, and why not: its family (format/families/), every problem the gates would
    refuse it for, and what serving it means (the family's notes, what the completeness check covered)."""

    family: str | None
    served: bool
    reasons: list[str]
    notes: list[str]


def support(pack: Pack) -> Support:
    problems = pack.problems()
    family = pack.family
    notes = list(family.notes) if family else [f"{pack.architecture} is in none of the families the plugin knows "
                                                "(format/families/): vLLM decides whether it serves it"]
    return Support(family.name if family else None, not problems, [str(p) for p in problems], notes + pack.notes)


@dataclass
class PackSummary:
    path: str
    architecture: str
    model_type: str
    num_layers: int | None
    num_experts: int | None
    experts_per_token: int | None
    hidden_size: int | None
    quantization: dict[str, Any]
    bits_histogram: dict[str, int]  # "4 mul1" -> tensors
    groups: dict[str, GroupStats] = field(default_factory=dict)
    unquantized_tensors: int = 0
    unquantized_bytes: int = 0
    support: Support | None = None

    @property
    def exl3_bytes(self) -> int:
        return sum(g.bytes for g in self.groups.values())

    @property
    def total_bytes(self) -> int:
        return self.exl3_bytes + self.unquantized_bytes

    @property
    def exl3_bits_per_weight(self) -> float:
        weights = sum(g.weights for g in self.groups.values())
        return 8 * self.exl3_bytes / weights if weights else 0.0

    def to_json(self) -> dict[str, Any]:
        data = asdict(self)
        for name, g in self.groups.items():
            data["groups"][name]["bits_per_weight"] = round(g.bits_per_weight, 4)
        data.update(exl3_bytes=self.exl3_bytes, total_bytes=self.total_bytes,
                    exl3_bits_per_weight=round(self.exl3_bits_per_weight, 4))
        return data


def _first(config: dict[str, Any], *keys: str) -> Any:
    return next((config[k] for k in keys if config.get(k) is not None), None)


def summarize(pack: Pack, with_support: bool = False) -> PackSummary:
    """What `pack` holds (its linears must be well-formed); `with_support`: and whether it is served (support())."""
    tc = pack.text_config
    qc = pack.quantization_config
    hist: Counter[str] = Counter()
    groups = {g: GroupStats() for g in GROUPS}
    for prefix, lin in pack.linears().items():
        hist[f"{format_bits(lin.bits)} {lin.codebook}"] += 1
        g = groups[tensor_group(prefix)]
        g.tensors += 1
        g.bytes += lin.nbytes
        g.weights += lin.in_padded * lin.out_padded
    unq = pack.unquantized()
    arch = pack.family.architectures[pack.architecture] if pack.family else None
    return PackSummary(
        path=str(pack.root),
        architecture=pack.architecture,
        model_type=str(tc.get("model_type", pack.config.get("model_type", "?"))),
        num_layers=tc.get("num_hidden_layers"),
        num_experts=arch.experts(tc)[1] or None if arch else _first(tc, "num_experts", "n_routed_experts",
                                                                    "num_local_experts"),
        experts_per_token=_first(tc, "num_experts_per_tok", "moe_k", "moe_topk", "top_k"),
        hidden_size=tc.get("hidden_size"),
        quantization={k: qc.get(k) for k in ("quant_method", "version", "bits", "head_bits", "codebook")
                      if k in qc},
        bits_histogram=dict(sorted(hist.items(), key=lambda kv: (float(kv[0].split()[0]), kv[0]))),
        groups={k: v for k, v in groups.items() if v.tensors},
        unquantized_tensors=len(unq),
        unquantized_bytes=sum(r.nbytes for r in unq.values()),
        support=support(pack) if with_support else None,
    )
