"""The numbers of a run, derived from the raw per-request records: per request decode speed and inter-token
latencies, per group (a phase, a category) means and percentiles. Pure functions over plain data (numpy)."""

from __future__ import annotations

from collections.abc import Iterable
from itertools import pairwise

import numpy as np

PERCENTILES = (50, 90, 99)
# The client's decode speed and the server's may differ by this fraction before the report calls it out (the client
# adds the network and its own scheduling; beyond this, tokens arrived in bursts).
AGREEMENT = 0.2


def decode_totals(requests: list[dict]) -> tuple[int, float]:
    """(tokens after the first chunk, seconds after it), summed over the successful requests."""
    tokens, seconds = 0, 0.0
    for r in requests:
        chunks = r.get("chunks") or []
        if r.get("ok") and len(chunks) >= 2:
            tokens += chunks[-1][1] - chunks[0][1]
            seconds += chunks[-1][0] - chunks[0][0]
    return tokens, seconds


def inter_chunk_s(req: dict) -> list[float]:
    """The gaps between token-carrying chunks (one decode step each on vLLM, which may carry several tokens)."""
    times = [t for t, _ in req.get("chunks") or []]
    return [b - a for a, b in pairwise(times)]


def _mean(values: Iterable[float | None]) -> float | None:
    v = [x for x in values if x is not None]
    return float(np.mean(v)) if v else None


def _percentiles(values: list[float], scale: float = 1.0) -> dict[str, float | None]:
    if not values:
        return {f"p{p}": None for p in PERCENTILES}
    got = np.percentile(np.asarray(values) * scale, PERCENTILES)
    return {f"p{p}": float(x) for p, x in zip(PERCENTILES, got)}


def summarize(requests: list[dict], wall_s: float | None = None) -> dict:
    """Means and percentiles of a group of requests (failed ones only counted as failed). `wall_s`: the group's
    wall time, for the aggregate tok/s of a phase."""
    ok = [r for r in requests if r.get("ok")]
    ttft = [1000 * r["ttft_s"] for r in ok]
    e2e = [1000 * r["e2e_s"] for r in ok]
    itl = [g for r in ok for g in inter_chunk_s(r)]
    tokens = sum(r["tokens"] for r in ok)
    # A ratio of sums, not a mean of per-request rates: a request whose tokens reached the client in one burst (a
    # busy client or proxy) has a near-zero decode time and would dominate a mean of rates.
    decode_tokens, decode_s = decode_totals(ok)
    return {
        "requests": len(requests), "failed": len(requests) - len(ok), "tokens": tokens,
        "decode_tok_s": decode_tokens / decode_s if decode_s > 0 else None,
        "ttft_ms": _mean(ttft), "e2e_ms": _mean(e2e),
        "ttft_ms_pct": _percentiles(ttft), "e2e_ms_pct": _percentiles(e2e), "itl_ms_pct": _percentiles(itl, 1000),
        "itl_ms": _mean(1000 * g for g in itl),
        "aggregate_tok_s": tokens / wall_s if wall_s and tokens else None,
    }


def speedup(a: float | None, b: float | None) -> float | None:
    return b / a if a and b is not None else None
