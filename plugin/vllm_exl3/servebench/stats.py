"""The numbers of a run, derived from the raw per-request records: per request decode speed and inter-token
latencies, per group (a phase, a category) means and percentiles. Pure functions over plain data (numpy)."""

from __future__ import annotations

from collections.abc import Iterable

import numpy as np

PERCENTILES = (50, 90, 99)


def decode_tokens_per_s(req: dict) -> float | None:
    """Tokens after the first chunk over the time after it: the decode speed alone, without the prefill."""
    chunks = req.get("chunks") or []
    if not req.get("ok") or len(chunks) < 2:
        return None
    (t_first, n_first), (t_last, n_last) = chunks[0], chunks[-1]
    return (n_last - n_first) / (t_last - t_first) if t_last > t_first else None


def inter_chunk_s(req: dict) -> list[float]:
    """The gaps between token-carrying chunks (one decode step each on vLLM, which may carry several tokens)."""
    times = [t for t, _ in req.get("chunks") or []]
    return [b - a for a, b in zip(times, times[1:])]


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
    return {
        "requests": len(requests), "failed": len(requests) - len(ok), "tokens": tokens,
        "decode_tok_s": _mean(decode_tokens_per_s(r) for r in ok),
        "ttft_ms": _mean(ttft), "e2e_ms": _mean(e2e),
        "ttft_ms_pct": _percentiles(ttft), "e2e_ms_pct": _percentiles(e2e), "itl_ms_pct": _percentiles(itl, 1000),
        "itl_ms": _mean(1000 * g for g in itl),
        "aggregate_tok_s": tokens / wall_s if wall_s and tokens else None,
    }


def speedup(a: float | None, b: float | None) -> float | None:
    return b / a if a and b is not None else None
