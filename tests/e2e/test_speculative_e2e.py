"""Speculative decoding with an EXL3 target on vLLM's CPU build: n-gram drafts and the pack's own MTP drafts are
lossless.

With greedy sampling a speculative method may change how many tokens a step yields, never which: the target
verifies every draft token and keeps only those it would have picked itself. Two servers of the bundled pack, one
plain and one with `--speculative-config` method `ngram` (drafts looked up in the prompt and the text so far, no
draft weights), must give the same tokens; vLLM's spec-decode counters show that drafts were proposed and accepted,
so the comparison covers verify steps that took several tokens. The same scrape checks that the counters the
recording rules read (deploy/prometheus/rules/recording.yml, group vllm-exl3-speculative) are there, with the labels
the rules group by and counts that agree with each other. Two boots in all.

The pack's own MTP layers (`mtp`) are served and lossless too: the GLM-4.5 fixture with an MTP layer appended
(dev/mtp.py), served plain and with one draft token a step (two more boots). The draft's tokens are the pack's own:
vLLM's counters equal, draft for draft, what the MTP layer computed on the pack's decoded weights without vLLM would
have had accepted, and the server's log says which MTP linears run EXL3 and which plain, as the pack stores them.
A pack without MTP layers is refused before the boot (tests/cli/test_speculative.py), as is `suffix`.
"""

from __future__ import annotations

import json
import math
import re
from collections import defaultdict

import pytest
import requests
import yaml
from prometheus_client.parser import text_string_to_metric_families
from support import qwen3_vl
from support.appliance import ROOT
from support.fixtures import pack_dir
from support.servers import cpu_env, vllm_server
from vllm_exl3 import demo
from vllm_exl3.dev import eagle3, golden_logprobs, mtp
from vllm_exl3.format.pack import Pack

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


def accepted_by_position(samples) -> dict[int, float]:
    """Accepted draft tokens by draft position, summed over engines."""
    per_pos: dict[int, float] = defaultdict(float)
    for s in samples:
        if s.name == "vllm:spec_decode_num_accepted_tokens_per_pos_total":
            per_pos[int(s.labels["position"])] += s.value
    return per_pos


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
    per_pos = accepted_by_position(samples)
    assert sorted(per_pos) == list(range(NGRAM["num_speculative_tokens"])), per_pos
    assert sum(per_pos.values()) == accepted, (per_pos, accepted)
    assert all(per_pos[i] >= per_pos[i + 1] for i in range(len(per_pos) - 1)), per_pos


# ---------------------------------------------------------------------------------------------------------------
# mtp: the pack's own multi-token-prediction layer
# ---------------------------------------------------------------------------------------------------------------
MTP = {"method": "mtp", "num_speculative_tokens": 1}
MTP_LINE = re.compile(r"EXL3 MTP layer (\d+): EXL3 (.*); plain (.*)$", re.MULTILINE)


def greedy_run(server) -> tuple[list[list[int]], list[list[int]]]:
    """(prompt token ids, as the server tokenizes them; greedy output tokens) of PROMPTS."""
    prompts = [requests.post(f"{server.base_url}/tokenize", json={"model": server.model, "prompt": p},
                             timeout=30).json()["tokens"] for p in PROMPTS]
    return prompts, greedy_tokens(server)


def expected_counts(drafts: list[int], tokens: list[int], prompt_len: int) -> tuple[int, int]:
    """(drafts proposed, drafts accepted) for one request at one draft token a step, given the token the MTP layer
    drafts after each position (`drafts[j]`: its guess for tokens[j + 2]): the prefill yields one token; then each
    step drafts after the last token but one (the drafter takes the target's hidden state there and the last token)
    and the target verifies, keeping the draft and its own next token when the draft is what it picks, else its own
    token only; until MAX_TOKENS are out (a last accepted draft may pass them: vLLM counts it, then cuts the text)."""
    out, proposed, accepted = 1, 0, 0
    while out < MAX_TOKENS:
        last = prompt_len + out - 1
        proposed += 1
        if drafts[last - 1] == tokens[last + 1]:
            accepted += 1
            out += 2
        else:
            out += 1
    return proposed, accepted


def vllm_layer(name: str) -> str:
    """The vLLM layer a checkpoint linear of GLM-4.5's decoder loads into (q/k/v fused, gate/up fused, every
    routed expert in one MoE layer)."""
    name = re.sub(r"\.experts\.\d+\.\w+$", ".experts", name)
    return re.sub(r"\.(gate|up)_proj$", ".gate_up_proj", re.sub(r"\.[qkv]_proj$", ".qkv_proj", name))


@pytest.fixture(scope="module")
def mtp_pack(tmp_path_factory):
    return mtp.add_mtp_layer(pack_dir("glm4moe-a-exl3-mcg-b4"), tmp_path_factory.mktemp("mtp") / "pack")


def test_mtp_drafts_from_the_packs_own_layer_are_lossless(mtp_pack, tmp_path_factory):
    """Covers: vLLM's GLM-4.5 drafter (Glm4MoeMTP) built through the plugin on an EXL3 target, its MTP layer
    loaded from the pack (eh_proj and the decoder layer's linears EXL3, the router plain), drafts verified one at a
    time, and verify steps that keep two tokens (the draft and the target's next) where the draft is accepted."""
    with vllm_server(mtp_pack, tmp_path_factory.mktemp("mtp-plain"), *EAGER_FP32) as server:
        plain = greedy_tokens(server)
    with vllm_server(mtp_pack, tmp_path_factory.mktemp("mtp-drafts"), *EAGER_FP32,
                     "--speculative-config", json.dumps(MTP)) as server:
        prompts, tokens = greedy_run(server)
        counters = totals(spec_samples(server))
        log = server.log.read_text()
    assert tokens == plain

    # Drafts were proposed and some kept, and exactly as many as the pack's own MTP layer earns: each draft the
    # layer computes on the pack's decoded weights (transformers' GLM-4.5 classes, no vLLM), checked against the
    # tokens the target verified. A layer of other weights drafts other tokens (tests/format/test_mtp_pack.py: the
    # same layer with another seed's decoder weights does), and its counts part from these.
    sequences = [p + t for p, t in zip(prompts, tokens)]
    expected = [expected_counts(d, s, len(p)) for d, s, p in zip(mtp.draft_tokens(mtp_pack, sequences), sequences,
                                                                 prompts)]
    proposed, accepted = (sum(e[i] for e in expected) for i in (0, 1))
    assert 0 < accepted < proposed, expected
    assert (counters["vllm:spec_decode_num_drafts_total"], counters["vllm:spec_decode_num_draft_tokens_total"],
            counters["vllm:spec_decode_num_accepted_tokens_total"]) == (proposed, proposed, accepted), \
        (counters, expected)

    # Each MTP linear ran as the pack stores it: EXL3 where it stores EXL3 tensors, vLLM's own method where it
    # stores a plain weight (the router). Names as vLLM's layers have them (q/k/v and gate/up fused).
    pack = Pack.open(mtp_pack)
    layer = f"model.layers.{pack.config['num_hidden_layers']}."
    exl3 = {vllm_layer(p) for p in pack.linears() if p.startswith(layer)}
    plain_linears = {vllm_layer(n[: -len(".weight")]) for n, rec in pack.tensors.items()
                     if n.startswith(layer) and n.endswith(".weight") and len(rec.shape) == 2}
    lines = MTP_LINE.findall(log)
    assert [(n, set(e.split(", ")), set(p.split(", "))) for n, e, p in lines] == \
        [(layer.split(".")[2], exl3, plain_linears)], lines
    assert f"{layer}eh_proj" in exl3 and plain_linears == {f"{layer}mlp.gate"}


# ---------------------------------------------------------------------------------------------------------------
# mtp on Qwen3.5/3.6-MoE: the pack's own `mtp.` module, one boot
# ---------------------------------------------------------------------------------------------------------------
FAMILIES = ROOT / "tests" / "fixtures" / "exl3-families"
# vLLM's CPU build runs the gated delta net in bf16 only (tests/e2e/test_families_e2e.py). Prefix caching off: with
# it vLLM keeps the delta net's state in its "align" mode, whose copy step under speculative decoding is a Triton
# kernel the CPU build lacks (`TypeError: 'function' object is not subscriptable` in mamba_utils.preprocess_mamba).
QWEN35_OPTIONS = ("--dtype", "bfloat16", "--enforce-eager", "--no-enable-prefix-caching")
# How far from the target's own pick a generated token may be at bf16, between the same server's decode and prefill
# of the same tokens (a verify step of two rows and a prefill of many round the same logits otherwise in bf16). On
# an AMD EPYC box with avx512_bf16, 10 of 144 tokens were 0.004-0.0625 nats below the pick (whole multiples of
# 2**-8), where the target's top five spread over 0.1-0.3 nats: a token within BF16_TIE counts as the pick, and the
# share of picks must reach the family tests' bf16 top-1 bound (golden_logprobs.BF16_TOP1); none may be more than
# BF16_LOGPROB below. A delta-net state not rolled back after a rejected draft moves tokens by the spread, not by a
# rounding.
BF16_TIE, BF16_LOGPROB = 0.0625, 0.125


@pytest.fixture(scope="module")
def qwen35_mtp_pack(tmp_path_factory):
    return mtp.add_mtp_layer(FAMILIES / "qwen35moe-a-exl3-mul1-b3.5", tmp_path_factory.mktemp("qwen35-mtp") / "pack")


def greedy_gaps(server, prompts: list[list[int]], tokens: list[list[int]]) -> list[float]:
    """For every generated token, how far (nats) below the target's own greedy pick it is: 0 where it is that pick.
    The same server's prompt log-probabilities over prompt + output (a prefill: the target alone, from scratch, no
    draft in it) give the target's distribution after each prefix."""
    out = []
    for prompt, generated in zip(prompts, tokens):
        dists = golden_logprobs.served_distributions(server.base_url, server.model, prompt + generated[:-1])
        for i, token in enumerate(generated):
            dist = dists[len(prompt) - 1 + i]
            out.append(max(dist.values()) - dist.get(token, -math.inf))
    return out


def test_qwen35_mtp_drafts_from_the_packs_own_module_are_lossless(qwen35_mtp_pack, tmp_path):
    """Covers: vLLM's Qwen3.5-MoE drafter (Qwen3_5MoeMTP) on an EXL3 target, its `mtp.` module as ExLlamaV3 1.6.5
    writes it (fc and the decoder layer's linears EXL3 at mtp_bits, the router and shared_expert_gate plain) loaded
    through the plugin, drafts verified one a step, some accepted.

    One boot, not two: at bf16 a plain server's greedy text and a drafting one's part where the target's top two
    tokens are closer than bf16 resolves (the fixture's random weights give near-flat logits: measured, the three
    requests part at tokens 34, 7 and 16, each where the top two were 0.004-0.012 nats apart), and a verify step of
    two tokens rounds otherwise than a decode step of one. So every generated token is checked against the target's
    own distribution after its prefix, from the same server's prefill (`greedy_gaps`), within the bounds bf16
    servers are held to: a draft that changed the text, or a delta-net state not rolled back after a rejected
    draft, gives tokens the target would not have picked."""
    env = {"PYTHONPATH": qwen3_vl.pythonpath()} if qwen3_vl.needed() else {}
    with vllm_server(qwen35_mtp_pack, tmp_path, *QWEN35_OPTIONS, "--speculative-config", json.dumps(MTP),
                     env=cpu_env(**env)) as server:
        prompts, tokens = greedy_run(server)
        counters = totals(spec_samples(server))
        gaps = greedy_gaps(server, prompts, tokens)
        log = server.log.read_text()

    assert max(gaps) <= BF16_LOGPROB and sum(g <= BF16_TIE for g in gaps) >= golden_logprobs.BF16_TOP1 * len(gaps), gaps
    drafts = counters["vllm:spec_decode_num_drafts_total"]
    accepted = counters["vllm:spec_decode_num_accepted_tokens_total"]
    assert counters["vllm:spec_decode_num_draft_tokens_total"] == drafts  # one draft token a step
    assert 0 < accepted < drafts, counters  # the pack's fc passes the token embedding: some drafts are kept

    # Each MTP linear ran as the pack stores it: EXL3 (fc, attention, shared expert, routed experts) or plain (the
    # router and shared_expert_gate), under the checkpoint's names (vLLM fuses q/k/v and gate/up).
    pack = Pack.open(qwen35_mtp_pack)
    exl3 = {vllm_layer(p) for p in pack.linears() if p.startswith("mtp.")}
    plain_linears = {vllm_layer(n[: -len(".weight")]) for n, rec in pack.tensors.items()
                     if n.startswith("mtp.") and n.endswith(".weight") and len(rec.shape) == 2}
    lines = MTP_LINE.findall(log)
    assert [(n, set(e.split(", ")), set(p.split(", "))) for n, e, p in lines] == [("0", exl3, plain_linears)], lines
    assert "mtp.fc" in exl3 and plain_linears == {"mtp.layers.0.mlp.gate", "mtp.layers.0.mlp.shared_expert_gate"}


# ---------------------------------------------------------------------------------------------------------------
# eagle3: a separate bf16 draft head beside the EXL3 target
# ---------------------------------------------------------------------------------------------------------------
EAGLE3_TOKENS = 2


def test_eagle3_drafts_from_a_separate_bf16_head_are_lossless(plain_tokens, tmp_path):
    """The bundled pack (Qwen3-MoE, which vLLM gives EAGLE-3 support) with a bf16 EAGLE-3 head (dev/eagle3.py: it
    drafts the token the target has just produced). vLLM builds the head from the head's own config, without a
    quantization config (none in it, and the speculative config asks for none): the plugin indexes the target
    pack alone, the head's linears load their plain weights and its drafts are accepted where the target repeats
    a token, which a head on unloaded weights would almost never be."""
    head = eagle3.write_head(demo.PACK, tmp_path / "head")
    config = {"method": "eagle3", "model": str(head), "num_speculative_tokens": EAGLE3_TOKENS}
    with vllm_server(demo.PACK, tmp_path, *EAGER_FP32, "--speculative-config", json.dumps(config)) as server:
        tokens = greedy_tokens(server)
        samples = spec_samples(server)
        log = server.log.read_text()
    assert tokens == plain_tokens
    counters = totals(samples)
    drafts = counters["vllm:spec_decode_num_drafts_total"]
    drafted = counters["vllm:spec_decode_num_draft_tokens_total"]
    accepted = counters["vllm:spec_decode_num_accepted_tokens_total"]
    assert drafts > 0 and drafted == EAGLE3_TOKENS * drafts and 0 < accepted < drafted, counters
    per_pos = accepted_by_position(samples)
    assert sum(per_pos.values()) == accepted and per_pos[0] >= per_pos[1], per_pos
    # The EXL3 config read the target pack and nothing else: the head was never handed to it.
    indexed = re.findall(r"EXL3 pack (\S+): \d+ EXL3 linears", log)
    assert indexed and set(indexed) == {str(demo.PACK)}, indexed
    assert "without its own lm_head" in log, "vLLM shares the target's (EXL3) head with the draft"
