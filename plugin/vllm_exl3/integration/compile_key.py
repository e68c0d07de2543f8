"""The plugin's kernel choices in vLLM's torch.compile cache key.

vLLM keys its compile cache (`$VLLM_CACHE_ROOT/torch_compile_cache/...`, AOT artifacts included) by its own
configs, its own environment variables and the source files Dynamo traced; the plugin's custom ops are opaque to
Dynamo, so nothing of the plugin's kernels is in any factor. When the backend was a constant argument of the op and
its prepared tensors were graph inputs, a boot that reused a graph compiled for another backend failed in
`assert_size_stride` during warm-up; the ops now find each layer's binding at run time (kernels/ops.py), and this
key still keeps every kernel build and plugin version in its own cache entry. vLLM hashes
`VllmConfig.additional_config` (a free-form dict) into the same key and computes that key only at the model's first
forward, after every layer was loaded and bound: so each worker records what it chose there, under its own name,
and a different choice is a different cache entry. The choice per layer type is final by then (the parity gate's
fallbacks included).
"""

from __future__ import annotations

import logging
from typing import Any

from ..base.version import __version__
from ..kernels import selection
from ..kernels.backend import get_backend

logger = logging.getLogger(__name__)

KEY = "vllm_exl3"
_config: Any = None
_warned = False


def capture(vllm_config: Any) -> None:
    """Remember the VllmConfig the model is being built with (called while vLLM constructs the layers, when
    `get_current_vllm_config()` is the engine's own)."""
    global _config
    if vllm_config is not None and getattr(vllm_config, "model_config", None) is not None:
        _config = vllm_config


def factors() -> dict[str, Any]:
    """What this process chose: backend per layer type, each chosen backend's build, the plugin's version."""
    chosen = sorted({(d.layer_type, d.backend) for d in selection.decision_counts()})
    return {"version": __version__, "layers": [f"{t}={b}" for t, b in chosen],
            "builds": {b: get_backend(b).build_id() for b in sorted({b for _, b in chosen})}}


def record() -> None:
    """Put `factors()` into the captured config's additional_config (after each bound layer; cheap)."""
    global _warned
    if _config is None:
        return
    extra = getattr(_config, "additional_config", None)
    if isinstance(extra, dict):
        extra[KEY] = factors()
    elif not _warned:
        logger.warning("EXL3: additional_config is not a dict (%s); the torch.compile cache cannot be keyed by the "
                       "kernel backend: use a separate VLLM_CACHE_ROOT per backend", type(extra).__name__)
        _warned = True
