"""A saved source model's directory made ready for ExLlamaV3's converter (used by golden.py and arch_sources.py)."""
import json
import os
import shutil


def finish(d, tokdir):
    """transformers 5 renamed config keys that ExLlamaV3 (and older readers) look up: write both spellings; then the
    tokenizer files beside the weights."""
    cp = os.path.join(d, "config.json")
    c = json.load(open(cp))
    if "num_local_experts" in c and "num_experts" not in c:
        c["num_experts"] = c["num_local_experts"]
    rp = c.get("rope_parameters") or {}
    if "rope_theta" not in c and "rope_theta" in rp:
        c["rope_theta"] = rp["rope_theta"]
    json.dump(c, open(cp, "w"), indent=2)
    for f in os.listdir(tokdir):
        shutil.copy(os.path.join(tokdir, f), d)
