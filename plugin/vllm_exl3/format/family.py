"""A model family as data (header-only: no torch): the architectures it covers with their tensor tables
(architectures.py), the config values it reads with their valid ranges, and the config keys that change its math.

Every gate (`verify`, preflight, the plugin's own check inside `vllm serve`) asks the family of a pack's
architecture: a config value vLLM's model for that family reads but the config lacks, or one out of range, is
refused naming the key before vLLM spends a boot on it (vLLM reads most of them as plain attributes: an absent one is
an AttributeError deep in the engine, a zero epsilon a NaN). A key that asks for math the plugin does not compute
(a clamped SwiGLU on a family whose experts have no clamp) is refused too: serving without it would silently answer
with another model. The families themselves are modules of format/families/.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from .architectures import Architecture
from .errors import Exl3FormatError

_KIND_NAMES = {int: "an integer", float: "a number", str: "a string", bool: "true or false", list: "a list",
               dict: "an object"}


@dataclass(frozen=True)
class Key:
    """A config value the family's model reads. `kinds`: the JSON types it may have (an int is a float too);
    `least` / `above`: inclusive / exclusive lower bounds; `choices`: the values it may take; `required`: vLLM's
    model reads it with no default (the config must carry it); `reads`: who reads it, for the message; `within`: the
    key is inside that object of the config (transformers 5 keeps rope_theta inside rope_parameters), when present;
    `missing`: for a required key the config lacks, what its other values say it should be (the fix to add)."""

    name: str
    kinds: tuple[type, ...] = (int,)
    least: float | None = None
    above: float | None = None
    choices: tuple[Any, ...] | None = None
    required: bool = False
    reads: str = ""
    within: str | None = None
    missing: Callable[[Mapping[str, Any]], str | None] | None = None

    def problem(self, config: Mapping[str, Any], path: Path, where: str) -> Exl3FormatError | None:
        if self.within is not None:
            inner = config.get(self.within)
            if not isinstance(inner, Mapping):
                return None  # absent, or not an object: its own Key says so
            config, where = inner, f"{where}{self.within}."
        if self.name not in config or config[self.name] is None:
            if not self.required:
                return None
            found = self.missing(config) if self.missing is not None else None
            return Exl3FormatError(path, None, f"{where}{self.name}, which {self.reads} reads with no default",
                                   found or "none (a config written for another reader; add the value the "
                                   "released checkpoint's config.json has)")
        value = config[self.name]
        kinds = self.kinds + ((int,) if float in self.kinds and int not in self.kinds else ())
        if isinstance(value, bool) and bool not in kinds or not isinstance(value, kinds):
            expected = " or ".join(_KIND_NAMES.get(k, k.__name__) for k in self.kinds)
            return Exl3FormatError(path, None, f"{where}{self.name} as {expected}", repr(value)[:80])
        if isinstance(value, float) and not math.isfinite(value):
            return Exl3FormatError(path, None, f"{where}{self.name} as a finite number", repr(value))
        bounds = []
        if self.least is not None and value < self.least:
            bounds.append(f"at least {self.least:g}")
        if self.above is not None and value <= self.above:
            bounds.append(f"above {self.above:g}")
        if bounds:
            return Exl3FormatError(path, None, f"{where}{self.name} {' and '.join(bounds)}"
                                   + (f" ({self.reads})" if self.reads else ""), repr(value))
        if self.choices is not None and value not in self.choices:
            return Exl3FormatError(path, None, f"{where}{self.name} one of {', '.join(map(repr, self.choices))}"
                                   + (f" ({self.reads})" if self.reads else ""), repr(value)[:80])
        return None


# Config keys that change a model's math, with what they ask for. A family computes the ones it lists in
# `implements`; any other present (and not null, false or zero) is refused: vLLM's model for the family may
# read it, but the plugin's expert kernels would not apply it.
MATH_KEYS = {
    "swiglu_limit": "a clamped SwiGLU in the experts (the clamp limit)",
    "swiglu_limits": "clamped SwiGLUs, one limit per layer",
    "swiglu_alpha": "a SwiGLU with a scaled sigmoid",
}


@dataclass(frozen=True)
class GroupedRouting:
    """Routing by groups (vLLM's grouped_topk): the experts split into `groups` equal groups, the best `chosen`
    groups are kept, and top-k experts are picked among theirs. Each group is scored by its best two experts when
    the router has a correction bias. Out of these bounds vLLM's router raises on the first request (the engine dies:
    HTTP 500) or picks experts it masked out."""

    experts: str
    groups: str = "n_group"
    chosen: str = "topk_group"
    top_k: str = "num_experts_per_tok"
    group_least: int = 2

    def problem(self, config: Mapping[str, Any], path: Path, where: str) -> Exl3FormatError | None:
        e, g, k, top = (config.get(n) for n in (self.experts, self.groups, self.chosen, self.top_k))
        if not all(isinstance(v, int) and not isinstance(v, bool) and v > 0 for v in (e, g, k)):
            return None  # absent or out of range: the Keys say so
        found = f"{self.experts} = {e}, {self.groups} = {g}, {self.chosen} = {k}"
        if k > g:
            expected = f"{where}{self.chosen} at most {where}{self.groups} (the groups kept among the groups)"
        elif e % g or e // g < self.group_least:
            expected = (f"{where}{self.groups} dividing the {e} routed experts into groups of at least "
                        f"{self.group_least} (each group is scored by its best {self.group_least})")
        elif isinstance(top, int) and top > k * (e // g):
            expected = (f"{where}{self.top_k} at most the {k * (e // g)} experts of the {k} groups kept")
            found += f", {self.top_k} = {top}"
        else:
            return None
        return Exl3FormatError(path, None, expected, found)


@dataclass(frozen=True)
class Family:
    """One model family: `architectures` maps each Hugging Face architecture name it covers to its tensor table.
    `examples`: packs users download (docs/packs.md); `config`: the values its model reads; `implements`: the
    MATH_KEYS it computes; `notes`: what serving it means beyond the tables (said by `vllm-exl3 inspect`);
    `rules`: checks across several of its config values (GroupedRouting), made once every value is in range."""

    name: str
    architectures: Mapping[str, Architecture]
    config: tuple[Key, ...] = ()
    implements: frozenset[str] = frozenset()
    examples: tuple[str, ...] = ()
    notes: tuple[str, ...] = field(default=())
    rules: tuple[GroupedRouting, ...] = ()

    def config_problems(self, config: Mapping[str, Any], path: Path, where: str = "") -> list[Exl3FormatError]:
        """Every value of `config` (the text config) this family's model reads that it lacks or that is out of
        range, and every math key it does not compute."""
        problems = [p for p in (key.problem(config, path, where) for key in self.config) if p]
        if not problems:
            problems = [p for p in (rule.problem(config, path, where) for rule in self.rules) if p]
        for key, asks in MATH_KEYS.items():
            if key not in self.implements and config.get(key) not in (None, False, 0, [], {}):
                problems.append(Exl3FormatError(
                    path, None, f"no {where}{key} ({self.name} packs are served without {asks})",
                    f"{key} = {config[key]!r}: the experts would run without it and answer as another model"))
        return problems


# Values most families read, shared by their tables (a family adds its own).
HIDDEN = Key("hidden_size", least=1, required=True, reads="every model")
LAYERS = Key("num_hidden_layers", least=1, required=True, reads="every model")
HEADS = Key("num_attention_heads", least=1, required=True, reads="the attention")
KV_HEADS = Key("num_key_value_heads", least=1, reads="the attention")
HEAD_DIM = Key("head_dim", least=1, reads="the attention")
NORM_EPS = Key("rms_norm_eps", kinds=(float,), above=0, reads="every RMSNorm (0 or less divides by zero: NaN)")
ROPE_THETA = Key("rope_theta", kinds=(float,), above=0, reads="the rotary embedding")
ROPE = (ROPE_THETA, Key("rope_parameters", kinds=(dict,), reads="the rotary embedding"),
        Key("rope_theta", kinds=(float,), above=0, reads="the rotary embedding", within="rope_parameters"),
        Key("partial_rotary_factor", kinds=(float,), above=0, reads="the rotary embedding", within="rope_parameters"),
        Key("rope_type", kinds=(str,), reads="the rotary embedding", within="rope_parameters"))
TOP_K = Key("num_experts_per_tok", least=1, reads="the router")
COMMON = (HIDDEN, LAYERS, HEADS, KV_HEADS, HEAD_DIM, NORM_EPS) + ROPE
# DeepSeek-style routing (GLM): groups of experts, a scaled sum of the chosen experts' weights
GROUPED = (Key("n_group", least=1, required=True, reads="the grouped router"),
           Key("topk_group", least=1, required=True, reads="the grouped router"),
           Key("routed_scaling_factor", kinds=(float,), above=0, required=True,
               reads="the router (0 zeroes the experts)"))
