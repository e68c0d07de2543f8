"""Does a served model compute what ExLlamaV3 computes? Compare its prompt log-probabilities with golden logits.

Used by the end-to-end tests and `bench/parity_cpu.py`; any OpenAI-compatible vLLM server works (it needs vLLM's
`prompt_logprobs` and `return_tokens_as_token_ids` extensions).
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass

import torch

from ..base.http import http_json

TOP_K = 20


@dataclass
class ParityReport:
    positions: int
    top1_agreement: float  # fraction of the positions with one argmax whose argmax token is ExLlamaV3's
    median_abs_logprob_delta: float  # |log p_ours - log p_exl3| of ExLlamaV3's argmax token (nats)
    max_abs_logprob_delta: float


def served_distributions(base_url: str, model: str, ids: list[int]) -> list[dict[int, float]]:
    """Top-K log-probs the server assigns at every position t (predicting token t+1), len(ids) entries."""
    r = http_json(f"{base_url}/v1/completions", 120, {
        "model": model, "prompt": ids, "max_tokens": 1, "temperature": 0, "logprobs": TOP_K,
        "prompt_logprobs": TOP_K, "return_tokens_as_token_ids": True})["choices"][0]
    dists = [{int(k): v["logprob"] for k, v in d.items()} for d in r["prompt_logprobs"][1:]]
    dists.append({int(k.split(":")[1]): v for k, v in r["logprobs"]["top_logprobs"][0].items()})
    return dists


# The top-2 margin (nats) below which a bf16 server cannot resolve the order of two logits: bf16 keeps 8 significant
# bits, so logits of magnitude up to 2 (the tiny fixture models') are rounded by up to 2 * 2**-8 ≈ 0.008.
BF16_MARGIN = 0.01
# The top-1 agreement a bf16 server must reach over the positions it can resolve: a bf16 router still flips experts
# whose logits are closer than its rounding (tests/e2e/test_families_e2e.py: one flip in Qwen3.5's 62 positions).
BF16_TOP1 = 0.94


def compare(base_url: str, model: str, input_ids: torch.Tensor, logits: torch.Tensor,
            min_margin: float = 0.0) -> ParityReport:
    """input_ids [B, T] and golden logits [B, T, V] (ExLlamaV3's, from the fixture's golden/logits).

    A position whose golden logits tie at the top has no argmax to agree with (a token whose embedding is zero, as
    the pad token of the tiny fixture models, gives all-zero logits): top-1 counts the others only; with
    `min_margin` (BF16_MARGIN for a server that computes in bf16), only those whose top two differ by more."""
    agree, ranked, deltas = 0, 0, []
    for ids, ref_logits in zip(input_ids.tolist(), logits):
        ref = ref_logits.double().log_softmax(-1)
        for t, dist in enumerate(served_distributions(base_url, model, ids)):
            top2 = ref[t].topk(2).values
            best = int(ref[t].argmax())
            if top2[0] - top2[1] > min_margin:
                ranked += 1
                agree += max(dist, key=dist.get) == best
            deltas.append(abs(dist[best] - ref[t, best].item()) if best in dist else math.inf)
    return ParityReport(len(deltas), agree / max(ranked, 1), statistics.median(deltas), max(deltas))
