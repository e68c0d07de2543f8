"""Speculative decoding with an EXL3 target on vLLM's CPU build: n-gram drafts are lossless.

With greedy sampling a speculative method may change how many tokens a step yields, never which: the target
verifies every draft token and keeps only those it would have picked itself. Two servers of the bundled pack, one
plain and one with `--speculative-config` method `ngram` (drafts looked up in the prompt and the text so far, no
draft weights), must give the same tokens; vLLM's spec-decode counters show that drafts were proposed and accepted,
so the comparison covers verify steps that took several tokens. Two boots in all.

`mtp` and `suffix` are refused before the boot (tests/cli/test_speculative.py); docs/performance.md says why.
"""

from __future__ import annotations

import json
import re

import pytest
import requests
from support.servers import vllm_server
from vllm_exl3 import demo

pytestmark = pytest.mark.e2e

EAGER_FP32 = ("--dtype", "float32", "--enforce-eager")
NGRAM = {"method": "ngram", "num_speculative_tokens": 3, "prompt_lookup_min": 2, "prompt_lookup_max": 4}
# Text that repeats itself gives the n-gram lookup something to find; the demo pack (random weights) also falls
# into loops of its own under greedy sampling, which is where drafts are accepted.
PROMPTS = ["one two three one two three one two three one two three", "def fibonacci(n):",
           "The history of the city begins"]
MAX_TOKENS = 48


def greedy_tokens(server) -> list[list[int]]:
    out = []
    for prompt in PROMPTS:
        r = server.post("/v1/completions", prompt=prompt, max_tokens=MAX_TOKENS, temperature=0, logprobs=0,
                        return_tokens_as_token_ids=True, ignore_eos=True)
        out.append([int(t.split(":")[1]) for t in r["choices"][0]["logprobs"]["tokens"]])
    assert all(len(t) == MAX_TOKENS for t in out)
    return out


def spec_counters(server) -> dict[str, float]:
    """vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py), summed over its engines."""
    text = requests.get(f"{server.base_url}/metrics", timeout=30).text
    out: dict[str, float] = {}
    for name, value in re.findall(r"^vllm:(spec_decode_num_(?:drafts|draft_tokens|accepted_tokens)_total)\{[^}]*\} "
                                  r"(\S+)$", text, re.MULTILINE):
        out[name] = out.get(name, 0.0) + float(value)
    return out


@pytest.fixture(scope="module")
def plain_tokens(tmp_path_factory):
    with vllm_server(demo.PACK, tmp_path_factory.mktemp("plain"), *EAGER_FP32) as server:
        tokens = greedy_tokens(server)
        assert not spec_counters(server)  # no speculative decoding: vLLM exports no spec-decode counters
        return tokens


def test_ngram_drafts_are_lossless(plain_tokens, tmp_path):
    with vllm_server(demo.PACK, tmp_path, *EAGER_FP32, "--speculative-config", json.dumps(NGRAM)) as server:
        tokens = greedy_tokens(server)
        counters = spec_counters(server)
    assert tokens == plain_tokens
    drafted = counters["spec_decode_num_draft_tokens_total"]
    accepted = counters["spec_decode_num_accepted_tokens_total"]
    # Not vacuous: steps verified drafts and kept some (on the pack's loops), and threw some away.
    assert counters["spec_decode_num_drafts_total"] > 0 and 0 < accepted < drafted, counters
