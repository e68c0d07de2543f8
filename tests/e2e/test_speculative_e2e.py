"""Speculative decoding with an EXL3 target on vLLM's CPU build: n-gram drafts are lossless.

With greedy sampling a speculative method may change how many tokens a step yields, never which: the target
verifies every draft token and keeps only those it would have picked itself. Two servers of the bundled pack, one
plain and one with `--speculative-config` method `ngram` (drafts looked up in the prompt and the text so far, no
draft weights), must give the same tokens; vLLM's spec-decode counters show that drafts were proposed and accepted,
so the comparison covers verify steps that took several tokens. The same scrape checks that the counters the
recording rules read (deploy/prometheus/rules/recording.yml, group vllm-exl3-speculative) are there, with the labels
the rules group by and counts that agree with each other. Two boots in all.

`mtp` and `suffix` are refused before the boot (tests/cli/test_speculative.py); docs/performance.md says why.
"""

from __future__ import annotations

import json
import re
from collections import defaultdict

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families
from support.appliance import ROOT
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


def spec_samples(server) -> list:
    """The samples of vLLM's spec-decode counters (vllm/v1/spec_decode/metrics.py) on its /metrics, read with
    prometheus_client's parser, as Prometheus would scrape them."""
    text = requests.get(f"{server.base_url}/metrics", timeout=30).text
    return [s for family in text_string_to_metric_families(text) for s in family.samples
            if s.name.startswith("vllm:spec_decode_")]


def totals(samples) -> dict[str, float]:
    """Each counter summed over its engines (and draft positions), by sample name."""
    out: dict[str, float] = defaultdict(float)
    for s in samples:
        out[s.name] += s.value
    return dict(out)


def names_the_rules_read() -> set[str]:
    rules = yaml.safe_load((ROOT / "deploy" / "prometheus" / "rules" / "recording.yml").read_text())["groups"]
    return {m for g in rules for r in g["rules"] for m in re.findall(r"vllm:spec_decode_\w+", r["expr"])}


@pytest.fixture(scope="module")
def plain_tokens(tmp_path_factory):
    with vllm_server(demo.PACK, tmp_path_factory.mktemp("plain"), *EAGER_FP32) as server:
        tokens = greedy_tokens(server)
        assert spec_samples(server) == []  # no speculative decoding: vLLM exports no spec-decode counters
        return tokens


def test_ngram_drafts_are_lossless(plain_tokens, tmp_path):
    with vllm_server(demo.PACK, tmp_path, *EAGER_FP32, "--speculative-config", json.dumps(NGRAM)) as server:
        tokens = greedy_tokens(server)
        samples = spec_samples(server)
    assert tokens == plain_tokens
    counters = totals(samples)
    drafts = counters["vllm:spec_decode_num_drafts_total"]
    drafted = counters["vllm:spec_decode_num_draft_tokens_total"]
    accepted = counters["vllm:spec_decode_num_accepted_tokens_total"]
    # Not vacuous: steps verified drafts and kept some (on the pack's loops), and threw some away.
    assert drafts > 0 and 0 < accepted < drafted <= NGRAM["num_speculative_tokens"] * drafts, counters

    # What the recording rules read is there, with the label they keep (model_name; vLLM adds `engine`, which
    # they sum away): without this a renamed counter would leave the dashboard's speculative row silently empty.
    read = names_the_rules_read()
    assert read == {f"vllm:spec_decode_num_{n}_total" for n in
                    ("drafts", "draft_tokens", "accepted_tokens", "accepted_tokens_per_pos")}, read
    assert read <= set(counters), (read, set(counters))
    assert all(s.labels.get("model_name") for s in samples if s.name in read), samples

    # Per draft position: one series for each of the k positions, together the accepted total; a token is
    # accepted only if every one before it was, so the counts never grow with the position.
    per_pos = defaultdict(float)
    for s in samples:
        if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            per_pos[int(s.labels["position"])] += s.value
    assert sorted(per_pos) == list(range(NGRAM["num_speculative_tokens"])), per_pos
    assert sum(per_pos.values()) == accepted, (per_pos, accepted)
    assert all(per_pos[i] >= per_pos[i + 1] for i in range(len(per_pos) - 1)), per_pos
