"""Which tensors a model of a known architecture stores, as data, and the completeness check built on it (header-only:
no torch).

vLLM loads what a checkpoint holds and leaves the rest of the model as it was allocated: a pack without `lm_head`, a
projection, a norm or one expert boots healthy and answers empty text or NaN, and a tensor the model does not have is
ignored or stops the load half way. So every gate (`verify`, preflight, the plugin's own check inside `vllm serve`)
compares the pack with the set its config.json describes, both ways. The tables are the families' (format/families/);
an architecture without one is reported as "completeness not checked", never refused.

A linear may be stored as an EXL3 linear (`.trellis`, `.suh`, `.svh`, a marker, `.bias`) or as a plain `.weight`
(`.bias`): the extended contract keeps some dense layers in BF16 (docs/packs.md). Names are Hugging Face's, in the
layout ExLlamaV3's converter writes (one linear per routed expert, gate and up split); tests/format/
test_architectures.py compares each table with a checkpoint transformers saves, rewritten into that layout.
"""

from __future__ import annotations

import re
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .constants import SIDECAR_FILE
from .errors import Exl3FormatError
from .headers import TensorRecord

LAYERS = "model.layers"  # the decoder layers of most architectures: model.layers.<i>.…
EXPERTS = "mlp.experts"  # a layer's routed experts in most architectures: <layer>.mlp.experts.<e>.…
MAX_LISTED = 8  # missing or unexpected tensors named one by one; the rest are counted
NOT_CHECKED = "completeness not checked"  # how a note about an architecture without a table begins


@dataclass(frozen=True)
class Flag:
    """A config key read as a yes/no (a count is yes when positive), with the model's default when it is absent."""

    key: str
    default: bool = False

    def __call__(self, config: Mapping[str, Any], layer: int | None = None) -> bool:
        return bool(config.get(self.key, self.default))


@dataclass(frozen=True)
class LayerType:
    """Layer `layer` is of type `value`: config `layer_types[layer]` says so, or, for a config without that list,
    every `interval_key`-th layer (counting from 1) is `every` and the others are not."""

    value: str
    interval_key: str | None = None
    every: str | None = None

    def __call__(self, config: Mapping[str, Any], layer: int | None = None) -> bool:
        types = config.get("layer_types")
        if layer is None:
            return False
        if isinstance(types, list) and layer < len(types):
            return types[layer] == self.value
        interval = config.get(self.interval_key) if self.interval_key else None
        if isinstance(interval, int) and interval > 0:
            return ((layer + 1) % interval == 0) == (self.value == self.every)
        return False


@dataclass(frozen=True)
class Not:
    """The condition does not hold."""

    condition: "Condition"

    def __call__(self, config: Mapping[str, Any], layer: int | None = None) -> bool:
        return not holds(self.condition, config, layer)


@dataclass(frozen=True)
class All:
    """Every one of the conditions holds."""

    conditions: tuple["Condition", ...]

    def __call__(self, config: Mapping[str, Any], layer: int | None = None) -> bool:
        return all(holds(c, config, layer) for c in self.conditions)


Condition = bool | Flag | LayerType | Not | All


def holds(condition: Condition, config: Mapping[str, Any], layer: int | None = None) -> bool:
    return condition(config, layer) if callable(condition) else condition


@dataclass(frozen=True)
class Module:
    """One module's tensors. `linear`: an EXL3 linear or a plain `.weight` (with `.bias` when `bias` holds);
    otherwise the plain `tensors` only. `present`: the config gives the model (or this layer) this module;
    `optional`: it may be left out (a head tied to the embeddings, a tensor the converter does not write);
    `may_bias`: a linear that may carry a `.bias` or not (ExLlamaV3 writes the experts' biases of some sources and
    not of others)."""

    name: str
    linear: bool = True
    tensors: tuple[str, ...] = ("weight",)
    bias: Condition = False
    present: Condition = True
    optional: Condition = False
    may_bias: Condition = False


def linear(name: str, bias: Condition = False, present: Condition = True, optional: Condition = False,
           may_bias: Condition = False) -> Module:
    return Module(name, True, ("weight",), bias, present, optional, may_bias)


def plain(name: str, *tensors: str, present: Condition = True, optional: Condition = False) -> Module:
    return Module(name, False, tensors or ("weight",), False, present, optional)


@dataclass(frozen=True)
class Architecture:
    """The tensors of one architecture, with Hugging Face's names as ExLlamaV3's converter writes them: `top`
    outside the layers (under their full names), `layer` in every decoder layer (under `layers`.<i>), then either
    the dense MLP or the routed one (`sparse_mlp` beside `expert`, each routed expert's linears under
    `experts_path`.<e>). Which layers route: the first of `experts_keys` present gives the number of experts (none:
    every layer is dense; the config checks make every one present agree); layers below `dense_first_key`'s value,
    above `dense_after_key`'s and those listed under `dense_list_key` are dense; with `sparse_every_key`, only
    layers whose index plus `sparse_every_offset` is a multiple of its value route. `spare_layers_key`: that many
    layers after the last (multi-token prediction) may be stored; vLLM skips them, so are they here, as are the
    tensors under `spare_prefixes` (a vision tower, MTP modules: another part of the model, not checked here).
    `spare_layer_marks`: the modules only such a layer has (MTP's eh_proj, enorm, hnorm); a stored layer in that
    range without one is a decoder layer that a num_hidden_layers one too small leaves out (vLLM would skip it).
    `mtp_prefixes`: where MTP modules stored outside the layers live (spare too), `mtp_key` the config key vLLM's
    MTP drafter reads their number from; with `spare_layers_key`, that key."""

    top: tuple[Module, ...]
    layer: tuple[Module, ...]
    dense_mlp: tuple[Module, ...]
    sparse_mlp: tuple[Module, ...] = ()
    expert: tuple[str, ...] = ()
    experts_keys: tuple[str, ...] = ()
    dense_first_key: str | None = None
    dense_after_key: str | None = None
    dense_list_key: str | None = None
    sparse_every_key: str | None = None
    sparse_every_offset: int = 0
    spare_layers_key: str | None = None
    spare_layer_marks: tuple[str, ...] = ()
    layers: str = LAYERS
    experts_path: str = EXPERTS
    spare_prefixes: tuple[str, ...] = ()
    expert_may_bias: Condition = False
    mtp_prefixes: tuple[str, ...] = ()
    mtp_key: str | None = None

    def experts(self, config: Mapping[str, Any]) -> tuple[str | None, int]:
        """(the config key, the number of routed experts it gives); (None, 0) for a dense model."""
        key = next((k for k in self.experts_keys if config.get(k) is not None), None)
        return key, config[key] if key else 0

    def routes(self, config: Mapping[str, Any], layer: int) -> bool:
        if not self.experts(config)[1]:
            return False
        if self.dense_first_key and layer < (config.get(self.dense_first_key) or 0):
            return False
        if self.dense_after_key and config.get(self.dense_after_key) is not None \
                and layer > config[self.dense_after_key]:
            return False
        if self.dense_list_key and layer in (config.get(self.dense_list_key) or ()):
            return False
        every = config.get(self.sparse_every_key) or 1 if self.sparse_every_key else 1
        return (layer + self.sparse_every_offset) % every == 0

    def modules(self, config: Mapping[str, Any]) -> list[tuple[str, Module]]:
        """(full prefix, module) of every module a model with this config has."""
        out = [(m.name, m) for m in self.top if holds(m.present, config)]
        _, experts = self.experts(config)
        for i in range(config["num_hidden_layers"]):
            routed = self.routes(config, i)
            mods = self.layer + (self.sparse_mlp if routed else self.dense_mlp)
            out += [(f"{self.layers}.{i}.{m.name}", m) for m in mods if holds(m.present, config, i)]
            if routed:
                out += [(f"{self.layers}.{i}.{self.experts_path}.{e}.{p}", linear(p, may_bias=self.expert_may_bias))
                        for e in range(experts) for p in self.expert]
        return out

    def spare_layers(self, config: Mapping[str, Any], names: Collection[str]) -> set[int]:
        """The stored layers after the last that are spare (MTP): in `spare_layers_key`'s range, and holding one of
        `spare_layer_marks` where the table names them."""
        first = config["num_hidden_layers"]
        count = config.get(self.spare_layers_key) or 0 if self.spare_layers_key else 0
        found = {i for n in names if (i := self.layer_of(n)) is not None and first <= i < first + count}
        if not self.spare_layer_marks:
            return found
        return {i for i in found if any(n.startswith(f"{self.layers}.{i}.{m}.") for n in names
                                        for m in self.spare_layer_marks)}

    def mtp_missing(self, config: Mapping[str, Any], names: Collection[str]) -> str | None:
        """What a pack with this config and these tensor `names` lacks for vLLM's `mtp` drafter (the pack's own
        MTP layers), None when it has them. A draft layer without its tensors would be random weights: 0 % accepted."""
        key = self.spare_layers_key or self.mtp_key
        if key is None:
            return "the plugin knows no MTP layers for this architecture"
        count = config.get(key)
        if not isinstance(count, int) or count < 1:
            return f"its config declares no MTP layer ({key} = {count!r})"
        if self.spare_layers_key:
            if self.spare_layers(config, names):
                return None
            first = config["num_hidden_layers"]
            marks = f" holding {', '.join(self.spare_layer_marks)}" if self.spare_layer_marks else ""
            span = f"{first}..{first + count - 1}" if count > 1 else f"{first}"
            return f"it stores no MTP layer: no {self.layers}.{span}{marks} (the converter left them out)"
        if any(n.startswith(self.mtp_prefixes) for n in names):
            return None
        return f"it stores no MTP tensors: none under {', '.join(p + '*' for p in self.mtp_prefixes)} " \
               "(the converter left them out)"

    def mtp_tensors(self, config: Mapping[str, Any], names: Collection[str]) -> list[str]:
        """The stored tensors of the MTP layers (the spare layers after the last, the modules under
        `mtp_prefixes`): what vLLM loads only for its `mtp` drafter."""
        spare = self.spare_layers(config, names) if self.spare_layers_key else set()
        return [n for n in names if (self.mtp_prefixes and n.startswith(self.mtp_prefixes))
                or (spare and self.layer_of(n) in spare)]

    def mtp_layer_count(self, config: Mapping[str, Any]) -> int:
        """How many MTP layers the config declares (each holds an attention layer, with its KV cache, when vLLM's
        `mtp` drafter runs)."""
        key = self.spare_layers_key or self.mtp_key
        count = config.get(key) if key else None
        return count if isinstance(count, int) and count > 0 else 0

    def layer_of(self, name: str) -> int | None:
        """The decoder layer a tensor name is in, None outside the layers."""
        m = re.match(rf"^{re.escape(self.layers)}\.(\d+)\.", name)
        return int(m[1]) if m else None

    def expert_of(self, name: str) -> int | None:
        """The routed expert a tensor name belongs to, None for any other tensor."""
        m = re.match(rf"^{re.escape(self.layers)}\.\d+\.{re.escape(self.experts_path)}\.(\d+)\.", name)
        return int(m[1]) if m else None


def completeness(root: Path, architecture: str, arch: Architecture | None, known: Collection[str],
                 config: Mapping[str, Any], tensors: Mapping[str, TensorRecord],
                 exl3: Mapping[str, Mapping[str, TensorRecord]],
                 recorded: Mapping[str, Collection[str]] | None = None) -> tuple[list[Exl3FormatError], str]:
    """(problems, what was checked): every tensor `config` gives a model of `architecture` (whose table is `arch`;
    None: no table among the `known` architectures), and no other, against `tensors` (`exl3`: the EXL3 linears'
    tensors by prefix). `config` is the text config, its values type-checked. Without a table, the tensors the
    converter's ledger `recorded` (by module) must be there."""
    if arch is None:
        note = f"{NOT_CHECKED}: no tensor table for {architecture!r} (known: {', '.join(sorted(known))})"
        if not recorded:
            return [], note
        gone = {m: [n.rpartition(".")[2] for n in names if n not in tensors] for m, names in recorded.items()}
        return [Exl3FormatError(root / SIDECAR_FILE, module, f"the {len(recorded[module])} tensor(s) the "
                                "tensor_storage ledger records for this module", f"{', '.join(names)} missing")
                for module, names in gone.items() if names], \
            f"{note}; checked against the converter's tensor_storage ledger instead"
    if not isinstance(config.get("num_hidden_layers"), int):
        return [Exl3FormatError(root / "config.json", None, f"num_hidden_layers, as every {architecture} config has",
                                "none")], ""
    layers = config["num_hidden_layers"]
    key, experts = arch.experts(config)
    context = f"num_hidden_layers = {layers}" + (f", {key} = {experts}" if key else "")
    where = f"as a {architecture} with {context} ({root / 'config.json'}) has"
    taken: set[str] = set()
    missing: list[tuple[str, str]] = []  # (name, what it should be)
    for prefix, module in arch.modules(config):
        bias = holds(module.bias, config)
        allowed = (f"{prefix}.bias",) if bias or holds(module.may_bias, config) else ()
        if not module.linear:
            names = [f"{prefix}.{t}" for t in module.tensors]
            if not holds(module.optional, config):
                missing += [(n, "a plain tensor") for n in names if n not in tensors]
            taken.update(names)
        elif prefix in exl3:
            parts = exl3[prefix]
            taken.update(f"{prefix}.{s}" for s in parts if s != "bias" or allowed)
            if bias and "bias" not in parts:
                missing.append((f"{prefix}.bias", "the EXL3 linear's bias"))
        elif f"{prefix}.weight" in tensors:
            taken.update((f"{prefix}.weight", *allowed))
            if bias and f"{prefix}.bias" not in tensors:
                missing.append((f"{prefix}.bias", "the linear's bias"))
        elif not holds(module.optional, config):
            missing.append((prefix, f"an EXL3 linear ({prefix}.trellis, .suh, .svh) or a plain {prefix}.weight"))
    spare = arch.spare_layers(config, tensors)
    taken.update(n for n in tensors if arch.layer_of(n) in spare or n.startswith(arch.spare_prefixes + arch.mtp_prefixes))

    problems = [Exl3FormatError(root, name, f"{what}, {where}", "none in the pack")
                for name, what in missing[:MAX_LISTED]]
    if len(missing) > MAX_LISTED:
        problems.append(Exl3FormatError(root, None, f"every tensor {where}",
                                        f"{len(missing) - MAX_LISTED} more missing besides those named"))
    extra = _unexpected(tensors, exl3, taken)
    problems += [Exl3FormatError(file, name, f"only the tensors {where}", _why_unexpected(name, arch, config, exl3))
                 for name, file in extra[:MAX_LISTED]]
    if len(extra) > MAX_LISTED:
        problems.append(Exl3FormatError(root, None, f"only the tensors {where}",
                                        f"{len(extra) - MAX_LISTED} more it does not have besides those named"))
    return problems, f"complete for {architecture} ({context})"


def _unexpected(tensors: Mapping[str, TensorRecord], exl3: Mapping[str, Mapping[str, TensorRecord]],
                taken: set[str]) -> list[tuple[str, Path]]:
    """(name, file) of each tensor not `taken`; an EXL3 linear none of whose tensors is taken, once by its prefix."""
    out, whole = [], set()
    for name in sorted(n for n in tensors if n not in taken):
        prefix = name.rpartition(".")[0]
        if prefix in exl3 and not any(f"{prefix}.{s}" in taken for s in exl3[prefix]):
            if prefix not in whole:
                whole.add(prefix)
                out.append((prefix, tensors[name].file))
        else:
            out.append((name, tensors[name].file))
    return out


def _why_unexpected(name: str, arch: Architecture, config: Mapping[str, Any],
                    exl3: Mapping[str, Mapping[str, TensorRecord]]) -> str:
    what = "an EXL3 linear" if name in exl3 else "a tensor"
    layer = arch.layer_of(name + ".")
    if layer is not None and layer >= config["num_hidden_layers"]:
        why = f"{what} of layer {layer}, beyond num_hidden_layers = {config['num_hidden_layers']}"
        if arch.spare_layer_marks and config.get(arch.spare_layers_key):
            why += (f" and not a {arch.spare_layers_key} (MTP) layer: it holds no "
                    f"{', '.join(arch.spare_layer_marks)} (vLLM would skip a decoder layer)")
        return why
    expert = arch.expert_of(name + ".")
    key, experts = arch.experts(config)
    if expert is not None and key and expert >= experts:
        return f"{what} of expert {expert}, beyond {key} = {experts}"
    prefix, _, suffix = name.rpartition(".")
    if prefix in exl3:
        if suffix == "weight":
            return f"a plain .weight beside the EXL3 linear '{prefix}' (a stale copy: which one is the model?)"
        return f"a .{suffix} that the config does not give '{prefix}'"
    return f"{what} this model does not have (vLLM would ignore it or stop loading)"
