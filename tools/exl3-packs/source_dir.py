"""A saved source model's directory made ready for ExLlamaV3's converter (used by golden.py and arch_sources.py)."""
import json
import os
import shutil
import sys

# the plugin's format package (no torch, no vLLM): one rule for GLM-4.7-Flash's leading dense layers
sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "..", "plugin"))
from vllm_exl3.format.families.glm4_moe_lite import leading_dense_layers  # noqa: E402


def finish(d, tokdir):
    """transformers 5 renamed config keys that ExLlamaV3 (and older readers) look up: write both spellings (and
    GLM-4.7-Flash's first_k_dense_replace beside mlp_layer_types, as its released config has it); a vision tower's
    preprocessor settings; then the tokenizer files beside the weights."""
    cp = os.path.join(d, "config.json")
    c = json.load(open(cp))
    if "num_local_experts" in c and "num_experts" not in c:
        c["num_experts"] = c["num_local_experts"]
    rp = c.get("rope_parameters") or {}
    if "rope_theta" not in c and "rope_theta" in rp:
        c["rope_theta"] = rp["rope_theta"]
    types = c.get("mlp_layer_types")  # GLM-4.7-Flash: the released config's count of leading dense layers
    dense = leading_dense_layers(types) if isinstance(types, list) else None
    if dense is not None and "first_k_dense_replace" not in c:
        c["first_k_dense_replace"] = dense
    json.dump(c, open(cp, "w"), indent=2)
    vis = c.get("vision_config")
    if vis and not os.path.exists(os.path.join(d, "preprocessor_config.json")):
        # a vision tower: ExLlamaV3 (architecture/qwen3_vl.py's pp reader) and vLLM's processor read the image
        # preprocessor's settings with no default; the released Qwen3.5/3.6 values, at the tiny tower's patch sizes
        json.dump({"size": {"shortest_edge": 65536, "longest_edge": 16777216},
                   "patch_size": vis.get("patch_size", 16), "temporal_patch_size": vis.get("temporal_patch_size", 2),
                   "merge_size": vis.get("spatial_merge_size", 2), "image_mean": [0.5, 0.5, 0.5],
                   "image_std": [0.5, 0.5, 0.5], "image_processor_type": "Qwen2VLImageProcessorFast"},
                  open(os.path.join(d, "preprocessor_config.json"), "w"), indent=2)
    for f in os.listdir(tokdir):
        shutil.copy(os.path.join(tokdir, f), d)
