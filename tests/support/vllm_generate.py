"""Run one vLLM (CPU build) generation and print its greedy tokens and prompt logprobs as one JSON line.

Usage: python vllm_generate.py MODEL LOAD_FORMAT [EXTRA_CONFIG_JSON]. A subprocess per run keeps each engine's
load path (and its failure) isolated; the `__main__` guard is needed because vLLM spawns processes.
"""

from __future__ import annotations

import json
import sys

PROMPTS = ["Hello, my name is", "The capital of France is", "1 2 3 4 5"]
RESULT_PREFIX = "RESULT "


def main() -> None:
    from vllm import LLM, SamplingParams

    model, load_format = sys.argv[1], sys.argv[2]
    extra = json.loads(sys.argv[3]) if len(sys.argv) > 3 else {}
    llm = LLM(model=model, load_format=load_format, model_loader_extra_config=extra, enforce_eager=True,
              max_model_len=256, seed=0, dtype="bfloat16")
    params = SamplingParams(temperature=0.0, max_tokens=12, prompt_logprobs=1, logprobs=1)
    outputs = llm.generate(PROMPTS, params)
    print(RESULT_PREFIX + json.dumps([
        {"tokens": list(o.outputs[0].token_ids),
         "prompt_logprobs": [None if d is None else {str(k): v.logprob for k, v in d.items()}
                             for d in o.prompt_logprobs]}
        for o in outputs]), flush=True)


if __name__ == "__main__":
    main()
