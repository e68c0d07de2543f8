"""A separate EAGLE / EAGLE-3 draft head (`--speculative-config '{"method": "eagle3", "model": HEAD, ...}'`), read
from its directory's config.json and safetensors headers, never its tensor data: what the preflight checks against
the target pack and what the memory plan counts.

vLLM builds the head from the head's own config (docs/vllm-notes.md §10): its hidden width, its
decoder layers (each with an attention layer and its KV cache), the width of the target's hidden states its `fc`
reads (`target_hidden_size`, the head's `hidden_size` when absent) and which target layers those come from
(`eagle_aux_hidden_state_layer_ids` in the config, read alike by every vLLM runner; `eagle_config` keys that
vLLM's runners read differently; vLLM's default (2, n // 2, n - 3) otherwise).
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from .errors import Exl3FormatError
from .headers import read_safetensors_header


@dataclass(frozen=True)
class EagleHead:
    root: Path
    config: Mapping[str, Any]
    weight_bytes: int  # its tensors as stored (every *.safetensors file)

    @property
    def hidden_size(self) -> int | None:
        value = self.config.get("hidden_size")
        return value if isinstance(value, int) else None

    @property
    def target_hidden_size(self) -> int | None:
        value = self.config.get("target_hidden_size", self.hidden_size)
        return value if isinstance(value, int) else None

    @property
    def num_layers(self) -> int:
        value = self.config.get("num_hidden_layers")
        return value if isinstance(value, int) and value > 0 else 1

    @property
    def num_kv_heads(self) -> int:
        heads = self.config.get("num_attention_heads") or 1
        return int(self.config.get("num_key_value_heads") or heads)

    @property
    def head_dim(self) -> int:
        heads = int(self.config.get("num_attention_heads") or 1)
        return int(self.config.get("head_dim") or (self.hidden_size or 0) // heads)

    @property
    def quant_method(self) -> str | None:
        qc = self.config.get("quantization_config")
        return str(qc.get("quant_method")) if isinstance(qc, dict) and qc.get("quant_method") else None

    @property
    def uses_aux_hidden_states(self) -> bool:
        """EAGLE-3 reads several of the target's hidden states unless its eagle_config says otherwise."""
        eagle_config = self.config.get("eagle_config")
        return not isinstance(eagle_config, dict) or bool(eagle_config.get("use_aux_hidden_state", True))

    def aux_layer_id_readings(self, target_layers: int) -> list[tuple[int, ...]]:
        """The target layers whose hidden states the head reads, as each of vLLM's model runners picks them: a
        top-level `eagle_aux_hidden_state_layer_ids` in both; otherwise vLLM 0.32's runner reads `eagle_config`'s
        `eagle_aux_hidden_state_layer_ids` and 0.33's GPU runner its `layer_ids` (on an H100 it took the model's
        default for a head that had only the former: bench/notes/serving-run-14.md "Fourteenth run"), each
        falling back to the model's default (2, n // 2, n - 3). One reading, or two where the runners differ."""
        default = (2, target_layers // 2, target_layers - 3)

        def ids(value: Any) -> tuple[int, ...] | None:
            return tuple(int(i) for i in value) if isinstance(value, (list, tuple)) and value else None

        top = ids(self.config.get("eagle_aux_hidden_state_layer_ids"))
        if top:
            return [top]
        eagle_config = self.config.get("eagle_config")
        nested = eagle_config if isinstance(eagle_config, dict) else {}
        readings = [ids(nested.get("eagle_aux_hidden_state_layer_ids")) or default, ids(nested.get("layer_ids")) or default]
        return list(dict.fromkeys(readings))


def open_head(path: str | Path | None) -> tuple[EagleHead | None, str | None]:
    """(the head, None), or (None, why it cannot be read: no directory, no config.json, no safetensors file)."""
    if not path:
        return None, "no 'model' (the draft head's directory) in the speculative config"
    root = Path(path)
    if not root.is_dir():
        return None, f"{root} is not a directory (a local EAGLE head: config.json and *.safetensors)"
    try:
        config = json.loads((root / "config.json").read_text())
    except FileNotFoundError:
        return None, f"{root / 'config.json'} does not exist"
    except (OSError, ValueError) as e:
        return None, f"{root / 'config.json'} is not readable JSON: {e}"
    if not isinstance(config, dict):
        return None, f"{root / 'config.json'} is not a JSON object"
    files = sorted(root.glob("*.safetensors"))
    if not files:
        return None, f"{root} holds no *.safetensors file (the head's weights)"
    try:
        weight_bytes = sum(rec.nbytes for f in files for rec in read_safetensors_header(f).tensors.values())
    except Exl3FormatError as e:
        return None, str(e)
    return EagleHead(root, config, weight_bytes), None
