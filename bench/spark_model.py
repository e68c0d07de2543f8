"""The DGX Spark (GB10) predicted from a per-kernel model calibrated on the H200 (issue #30). A prediction, not a
measurement: no GB10 was lent. Inputs: bench/spark_model.toml (each value marked measured or assumed) and the
committed H200 result files it names.

Per kernel class, time = fixed (launch/latency, µs, the same on both GPUs) + max(bytes / achievable bandwidth,
work / issue rate), the issue rate scaling with SMs x schedulers x clock:
  exl3_moe    routed experts, one layer call: fixed 8 µs + max(distinct experts' bytes, decoded weights / (eff(T)
              x issue ceiling)); eff(T) = the fraction of the ceiling the H200 reached at T tokens (moe_rows)
  exl3_dense  one dense call (q/k/v as one grouped call up to `grouped_max_rows` rows, else each its own; o; a
              6-bit head): a_B + max(bytes, W x s_B), a_B and s_B fitted per row count B on the dense 4-bit rows
              (h200-kernels-v4u-exllamav3.json)
  marlin      vLLM's GPTQ layer (MoE + dense): a_m + max(bytes, W x s_m), a_m and s_m fitted on its end-to-end
              H200 steps minus the plain and rest terms below (W: the weights the layer reads), s_m scaled by the
              issue rate like every issue term
  plain       fp16 reads at the GEMV rate: the fp16 lm_head, the routers, the KV cache
  rest        one constant per step (norms, rope, attention and router launches, sampling, host): our measured
              steps minus the classes above, averaged over the three batches
Speculative decoding of one sequence (issue #45; `speculative`, inputs in [speculative] of the TOML, all assumed): a
verify step with k draft tokens is `step` at k + 1 rows with one sequence's KV cache (the dense fit interpolated over
log2(rows) between its fitted row counts: `dense_coef`), a draft token costs 0 (`ngram`) or one MTP pass at 1 row
(`draft`), tok/s = (1 - a^(k+1)) / (1 - a) / (verify + k x draft) at per-position acceptance a (iid), and the
break-even a is where that equals the plain batch-1 step's tok/s.
    python bench/spark_model.py [--json OUT] [--gbps 208] [--clock 2.0]"""
from __future__ import annotations

import argparse
import json
import math
from pathlib import Path

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    import tomli as tomllib  # type: ignore[no-redef]

HERE = Path(__file__).resolve().parent


def load_config(path: Path = HERE / "spark_model.toml") -> dict:
    return tomllib.loads(path.read_text())


def issue_ceiling(dev: dict, cfg: dict) -> float:
    """Weights per µs if every scheduler issued one warp instruction per cycle."""
    cycles_per_us = dev["sms"] * dev["schedulers_per_sm"] * dev["clock_ghz"] * 1e3
    return cycles_per_us / cfg["calibration"]["warp_instructions_per_weight"]


# --- routing (uniform top-k over E experts) ---------------------------------------------------------------------
def distinct_experts(tokens: int, experts: int, top_k: int) -> float:
    return experts * (1.0 - (1.0 - top_k / experts) ** tokens)


def rows_per_chunk(pairs: int, experts: int) -> int:  # csrc/moe.cu moe_rows_per_chunk
    avg = pairs // max(1, min(experts, pairs))
    return 8 if avg <= 8 else 16 if avg <= 32 else 64


def expert_decodes(tokens: int, experts: int, top_k: int, step: int = 1024) -> float:
    """Expected (expert, row chunk) pairs: each expert's tiles are decoded once per chunk of its rows."""
    total, p = 0.0, top_k / experts
    for t0 in range(0, tokens, step):
        tc = min(step, tokens - t0)
        r = rows_per_chunk(tc * top_k, experts)
        pmf, mean = (1.0 - p) ** tc, 0.0  # rows of one expert ~ Binomial(tc, p)
        for n in range(1, tc + 1):
            pmf *= (tc - n + 1) / n * p / (1.0 - p)
            mean += pmf * math.ceil(n / r)
        total += experts * mean
    return total


def expert_bytes(hidden: int, width: int, bits: float, kind: str = "exl3") -> float:
    scales = (hidden + width) * 2 if kind == "exl3" else 0  # suh/svh fp16; GPTQ's scales are in its 4.125 bits
    return 3 * (hidden * width * bits / 8 + scales)


def dense_shapes(m: dict) -> list[tuple[int, int]]:  # q, k, v, o
    q, kv = m["q_heads"] * m["head_dim"], m["kv_heads"] * m["head_dim"]
    return [(m["hidden"], q), (m["hidden"], kv), (m["hidden"], kv), (q, m["hidden"])]


def dense_calls(m: dict, rows: int, grouped_max_rows: int) -> list[list[tuple[int, int]]]:
    """The dense calls of one layer in our plugin, each the shapes it computes: q, k and v in one grouped call up
    to `grouped_max_rows` rows (integration/linear.py, csrc/bindings.cpp native_linear_group), else one each; o."""
    q, k, v, o = dense_shapes(m)
    return [[q, k, v], [o]] if rows <= grouped_max_rows else [[q], [k], [v], [o]]


def linear_fit(xs: list[float], ys: list[float]) -> tuple[float, float]:
    n, mx, my = len(xs), sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if n > 1 and sxx else 0.0
    return my - slope * mx, slope


# --- H200 MoE rows -----------------------------------------------------------------------------------------------
def moe_rows(cal: dict) -> list[dict]:
    """The MoE layer rows the model reads: the full token sweep of `moe_results`, brought to the kernels of
    `moe_current` (a later run at fewer token counts) where that names a file. A row the later run measured is taken
    as measured; one between two of its token counts keeps the sweep's shape, scaled by the later/earlier ratio
    interpolated over log2(tokens) between those two (a plain interpolation of the later points alone misses the
    sweep's own 4- and 32-token rows by 12 % and 7 %: bench/notes/serving-run-07.md "Seventh run")."""
    rows = json.loads((HERE / cal["moe_results"]).read_text())["rows"]
    if not cal.get("moe_current"):
        return rows
    now = {(r["layer"], r["bits"], r["tokens"]): r for r in json.loads((HERE / cal["moe_current"]).read_text())["rows"]}
    out = []
    for r in rows:
        key = (r["layer"], r["bits"], r["tokens"])
        if key in now:
            out.append({**now[key], "source": "current"})
            continue
        earlier = {e["tokens"]: e["native_graph_us"] for e in rows if (e["layer"], e["bits"]) == key[:2]}
        ratios = sorted((t, now[(*key[:2], t)]["native_graph_us"] / us) for t, us in earlier.items()
                        if (*key[:2], t) in now)
        if len(ratios) < 2 or not ratios[0][0] < r["tokens"] < ratios[-1][0]:
            continue  # outside what the later run covers: left out rather than extrapolated
        out.append({**r, "native_graph_us": r["native_graph_us"] * _interp_log2(r["tokens"], ratios),
                    "source": "scaled"})
    return out


def moe_row_rates(row: dict, cfg: dict) -> dict:
    shape = cfg["moe_layers"][row["layer"]]
    h, w, e, k = shape["hidden"], shape["width"], shape["experts"], shape["top_k"]
    decoded = expert_decodes(row["tokens"], e, k, cfg["calibration"]["chunk_step_tokens"]) * 3 * h * w
    per_us = decoded / row["native_graph_us"]
    return {"layer": row["layer"], "bits": row["bits"], "tokens": row["tokens"], "us": row["native_graph_us"],
            "distinct_experts": row["routed_bytes"] / expert_bytes(h, w, row["bits"]),
            "decoded_M": decoded / 1e6, "weights_per_us": per_us,
            "ceiling_fraction": per_us / issue_ceiling(cfg["devices"]["h200"], cfg), "source": row.get("source", "")}


class Model:
    def __init__(self, cfg: dict):
        self.cfg, self.m, cal = cfg, cfg["model"], cfg["calibration"]
        self.h200 = cfg["devices"]["h200"]
        self.moe_rows = moe_rows(cal)
        self.moe_h200 = {(r["bits"], r["tokens"]): r["native_graph_us"] for r in self.moe_rows
                         if r["layer"] == "qwen3-30b-a3b"}
        dense = json.loads((HERE / cal["dense_results"]).read_text())["table"]
        self.dense_points: dict[int, list[tuple[float, float]]] = {}
        for r in dense:
            if r["codebook"] == cal["dense_codebook"] and r["bits"] == cal["dense_bits"]:
                self.dense_points.setdefault(r["rows"], []).append((r["shape"][0] * r["shape"][1], r["ours_us"]))
        s = cfg["serving"]
        self.dense_fit = {b: linear_fit(*zip(*self.dense_points[b])) for b in s["batches"]}
        self.rest_ms, self.marlin_fit = 0.0, (0.0, 0.0)
        ours = [self.step(s["exl3_scheme"], "h200", b)["ms"] for b in s["batches"]]
        self.rest_ms = sum(e - o for e, o in zip(s["exl3_4bit_ms"], ours)) / len(ours)
        # Marlin's layer on the H200: a fixed part plus the weights it reads at a fitted rate (its steps grow with
        # the distinct experts' weights faster than the H200's bandwidth would make them grow).
        other = [self.step("gptq_4bit", "h200", b)["split_ms"] for b in s["batches"]]
        per_layer = [(g - sum(v for k, v in o.items() if k != "moe+dense")) * 1e3 / self.m["layers"]
                     for g, o in zip(s["gptq_4bit_ms"], other)]
        self.marlin_fit = linear_fit([self.gptq_layer(b)[0] for b in s["batches"]], per_layer)

    def dev(self, name: str) -> dict:
        return self.cfg["devices"][name]

    def gptq_layer(self, batch: int, bits: float = 4.125) -> tuple[float, float]:
        """(weights, bytes) one GPTQ layer reads at this batch: the distinct routed experts and the dense q/k/v/o."""
        m = self.m
        experts = distinct_experts(batch, m["experts"], m["top_k"])
        weights = experts * 3 * m["hidden"] * m["expert_width"] + sum(k * n for k, n in dense_shapes(m))
        return weights, experts * expert_bytes(m["hidden"], m["expert_width"], bits, "gptq") + sum(
            k * n for k, n in dense_shapes(m)) * bits / 8

    def marlin_us(self, dev: str, batch: int, bits: float) -> float:
        """One GPTQ layer: fixed + max(bytes at the device's bandwidth, weights at the H200-fitted rate scaled by the
        device's issue rate)."""
        a, s = self.marlin_fit
        weights, nbytes = self.gptq_layer(batch, bits)
        return a + max(nbytes / (self.dev(dev)["gbps"] * 1e3), weights * s * self.speed(dev))

    def speed(self, name: str) -> float:  # issue-bound work: H200 time x this
        return issue_ceiling(self.h200, self.cfg) / issue_ceiling(self.dev(name), self.cfg)

    def moe_us(self, dev: str, bits: float, tokens: int) -> dict:
        m, fixed = self.m, self.cfg["calibration"]["moe_fixed_us"]
        measured = sorted((t, us) for (b, t), us in self.moe_h200.items() if b == bits)
        h200_us = _interp_log2(tokens, measured)
        decoded = expert_decodes(tokens, m["experts"], m["top_k"]) * 3 * m["hidden"] * m["expert_width"]
        nbytes = distinct_experts(tokens, m["experts"], m["top_k"]) * expert_bytes(m["hidden"], m["expert_width"], bits)
        byte_us = nbytes / (self.dev(dev)["gbps"] * 1e3)
        issue_us = (h200_us - fixed) * self.speed(dev)  # eff(T) carried over: same fraction of the ceiling
        return {"us": fixed + max(byte_us, issue_us), "bytes": nbytes, "byte_us": byte_us, "issue_us": issue_us,
                "decoded": decoded, "bound": "bytes" if byte_us >= issue_us else "issue"}

    def dense_coef(self, rows: int) -> tuple[float, float]:
        """(a_B, s_B) of the dense fit at B = `rows`: the fit itself at a fitted row count ([serving] batches: 1, 8,
        32); between two of them each coefficient interpolated over log2(rows), as `_interp_log2` does for the MoE.
        The interpolation is an assumption (issue #45: the 2-5 rows of a verify step; no dense row count between 1
        and 8 was measured)."""
        if rows in self.dense_fit:
            return self.dense_fit[rows]
        fitted = sorted(self.dense_fit.items())
        return (_interp_log2(rows, [(b, a) for b, (a, _) in fitted]),
                _interp_log2(rows, [(b, s) for b, (_, s) in fitted]))

    def dense_us(self, dev: str, weights: float, nbytes: float, rows: int) -> float:
        a, s = self.dense_coef(rows)
        return a + max(nbytes / (self.dev(dev)["gbps"] * 1e3), weights * s * self.speed(dev))

    def plain_us(self, dev: str, nbytes: float) -> float:
        """fp16 reads at the device's GEMV rate."""
        return nbytes / (self.dev(dev)["cublas_gbps"] * 1e3)

    def layer_us(self, sc: dict, dev: str, rows: int, bits: float) -> tuple[dict, dict]:
        """(µs, bytes) of one decoder layer's quantized linears at `rows` rows, by kernel class: our MoE call and dense
        calls (EXL3), or vLLM's GPTQ layer."""
        m, us, nbytes = self.m, {}, {}
        if sc["kind"] == "exl3":
            moe = self.moe_us(dev, bits, rows)
            us["moe"], nbytes["moe"] = moe["us"], moe["bytes"]
            us["dense"], nbytes["dense"] = self.dense_calls_us(
                dev, dense_calls(m, rows, self.cfg["serving"]["grouped_max_rows"]), bits, rows)
        else:
            us["moe+dense"], nbytes["moe+dense"] = self.marlin_us(dev, rows, bits), self.gptq_layer(rows, bits)[1]
        return us, nbytes

    def dense_calls_us(self, dev: str, calls: list[list[tuple[int, int]]], bits: float, rows: int,
                       kind: str = "exl3") -> tuple[float, float]:
        """(µs, bytes) of dense calls, each the shapes it computes, with the dense fit at `rows` rows; EXL3 linears
        carry their fp16 suh/svh."""
        dense = [(sum(k * n for k, n in call),
                  sum(k * n * bits / 8 + ((k + n) * 2 if kind == "exl3" else 0) for k, n in call)) for call in calls]
        return sum(self.dense_us(dev, w, b, rows) for w, b in dense), sum(b for _, b in dense)

    def head_us(self, sc: dict, dev: str, rows: int) -> tuple[float, float]:
        """(µs, bytes) of the lm_head: fp16 at the GEMV rate, else one EXL3 dense call."""
        m = self.m
        head_w = m["vocab"] * m["hidden"]
        nbytes = head_w * sc["head_bits"] / 8
        return (self.plain_us(dev, nbytes) if sc["head_bits"] == 16 else
                self.dense_us(dev, head_w, nbytes + (m["vocab"] + m["hidden"]) * 2, rows)), nbytes

    def kv_bytes(self, seqs: int, layers: int) -> float:
        m = self.m
        return seqs * m["context"] * layers * 2 * m["kv_heads"] * m["head_dim"] * m["kv_bytes"]

    def step(self, scheme: str, dev: str, batch: int, seqs: int | None = None) -> dict:
        """ms per decode step of the whole model, split by kernel class: `batch` rows through every layer, the KV
        cache of `seqs` sequences read once (default: one sequence per row)."""
        m, sc, d = self.m, self.cfg["schemes"][scheme], self.dev(dev)
        layers = m["layers"]
        per_us, per_bytes = self.layer_us(sc, dev, batch, sc["bits"])
        us = {k: layers * v for k, v in per_us.items()}
        nbytes = {k: layers * v for k, v in per_bytes.items()}
        us["head"], nbytes["head"] = self.head_us(sc, dev, batch)
        nbytes["router"] = layers * m["experts"] * m["hidden"] * 2
        nbytes["kv"] = self.kv_bytes(batch if seqs is None else seqs, layers)
        us["router+kv"] = self.plain_us(dev, nbytes["router"] + nbytes["kv"])
        us["rest"] = self.rest_ms * 1e3
        ms = sum(us.values()) / 1e3
        return {"scheme": scheme, "device": dev, "batch": batch, "ms": ms, "tok_s": batch * 1e3 / ms,
                "weight_gb_per_step": sum(v for k, v in nbytes.items() if k != "kv") / 1e9,
                "floor_ms": sum(nbytes.values()) / (d["gbps"] * 1e6),
                "split_ms": {k: v / 1e3 for k, v in us.items()}}

    # --- speculative decoding (issue #45): one sequence, k draft tokens a step -----------------------------------
    def verify_step(self, scheme: str, dev: str, k: int) -> dict:
        """The target's verify step of ONE sequence with k draft tokens: k + 1 rows through every layer (the routed
        experts of k + 1 tokens, distinct under uniform routing; the dense calls and the head at k + 1 rows, the dense
        fit interpolated between fitted row counts: `dense_coef`), that sequence's KV cache read once, the same
        per-step rest. k = 0 is the plain batch-1 step."""
        r = self.step(scheme, dev, k + 1, seqs=1)
        del r["tok_s"]  # k + 1 rows, but not k + 1 tokens: see speculative()
        return {**r, "k": k}

    def draft(self, scheme: str, dev: str, method: str) -> dict:
        """ms per draft token. `ngram`: no weights read (vLLM's prompt lookup runs on the host; counted as 0).
        `mtp`: one pass of the MTP module at 1 row: a decoder layer of the trunk's shape (its MoE, dense calls,
        router and one layer of KV cache) at `[speculative] exl3_mtp_bits` for EXL3 packs, its eh_proj
        [2 x hidden -> hidden] as one dense call, the shared lm_head, and one layer's share of the per-step rest."""
        if method == "ngram":
            return {"method": method, "ms": 0.0, "split_ms": {}}
        if method != "mtp":
            raise ValueError(f"no draft model for {method!r}")
        m, sc, sp = self.m, self.cfg["schemes"][scheme], self.cfg["speculative"]
        bits = sp["exl3_mtp_bits"] if sc["kind"] == "exl3" else sc["bits"]
        us, _ = self.layer_us(sc, dev, 1, bits)
        us["eh_proj"], _ = self.dense_calls_us(dev, [[(2 * m["hidden"], m["hidden"])]], bits, 1, sc["kind"])
        us["head"], _ = self.head_us(sc, dev, 1)
        us["router+kv"] = self.plain_us(dev, m["experts"] * m["hidden"] * 2 + self.kv_bytes(1, 1))
        us["rest"] = self.rest_ms * 1e3 / m["layers"]
        return {"method": method, "bits": bits, "ms": sum(us.values()) / 1e3,
                "split_ms": {k: v / 1e3 for k, v in us.items()}}


def _interp_log2(x: float, pts: list[tuple[int, float]]) -> float:
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            f = (math.log2(x) - math.log2(x0)) / (math.log2(x1) - math.log2(x0))
            return y0 + f * (y1 - y0)
    raise ValueError(f"{x} tokens is outside the measured {pts[0][0]}..{pts[-1][0]}")


def tokens_per_step(a: float, k: int) -> float:
    """Expected tokens one verify step emits with k draft tokens when each draft token is accepted with probability a
    once the ones before it were: (1 - a^(k+1)) / (1 - a) (the accepted prefix plus the target's own next token;
    Leviathan et al. 2023, "Fast Inference from Transformers via Speculative Decoding", eq. 1). Assumption: iid
    acceptance; measured acceptance falls with the position, so a is the per-position rate it would take."""
    return k + 1.0 if a == 1 else (1 - a ** (k + 1)) / (1 - a)


def break_even(k: int, ratio: float, tol: float = 1e-12) -> float | None:
    """The acceptance rate a in (0, 1) at which k drafts a step pay for themselves: tokens_per_step(a, k) = `ratio`
    (a step's cost, verify plus drafts, over the plain step's), by bisection (tokens_per_step grows with a from 1 to
    k + 1); None where even a = 1 does not reach it, 0 where a = 0 already does."""
    if ratio <= 1:
        return 0.0
    if ratio >= k + 1:
        return None
    lo, hi = 0.0, 1.0
    while hi - lo > tol:
        mid = (lo + hi) / 2
        lo, hi = (mid, hi) if tokens_per_step(mid, k) < ratio else (lo, mid)
    return (lo + hi) / 2


def speculative(model: Model, dev: str) -> dict:
    """Per scheme, draft method and k of `[speculative]`: the verify step, the drafts' cost, tok/s of one sequence at
    each acceptance rate (tokens_per_step / (verify + k x draft)) against the plain batch-1 step, and the break-even
    acceptance rate."""
    sp = model.cfg["speculative"]
    plain = {k: model.step(k, dev, 1) for k in sp["schemes"]}
    verify = {(k, n): model.verify_step(k, dev, n) for k in sp["schemes"] for n in sp["draft_tokens"]}
    drafts = {(k, meth): model.draft(k, dev, meth) for k in sp["schemes"] for meth in sp["methods"]}
    rows = []
    for (scheme, meth), d in drafts.items():
        for n in sp["draft_tokens"]:
            ms = verify[scheme, n]["ms"] + n * d["ms"]
            at = {str(a): {"tokens_per_step": tokens_per_step(a, n), "tok_s": tokens_per_step(a, n) * 1e3 / ms,
                           "speedup": tokens_per_step(a, n) * plain[scheme]["ms"] / ms} for a in sp["acceptance"]}
            rows.append({"scheme": scheme, "method": meth, "k": n, "verify_ms": verify[scheme, n]["ms"],
                         "draft_ms_per_token": d["ms"], "step_ms": ms, "at": at,
                         "break_even": break_even(n, ms / plain[scheme]["ms"])})
    return {"device": dev, "plain": {k: {"ms": r["ms"], "tok_s": r["tok_s"]} for k, r in plain.items()},
            "verify_steps": list(verify.values()),
            "drafts": [{"scheme": k, **d} for (k, _), d in drafts.items()], "rows": rows}


def report(model: Model) -> dict:
    s = model.cfg["serving"]
    calib = [{"scheme": k, "batch": b, "measured_ms": meas, "model_ms": model.step(k, "h200", b)["ms"]}
             for k, key in ((s["exl3_scheme"], "exl3_4bit_ms"), ("gptq_4bit", "gptq_4bit_ms"))
             for b, meas in zip(s["batches"], s[key])]
    dense_err = [abs(a + sl * w - t) / t for b, (a, sl) in model.dense_fit.items() for w, t in model.dense_points[b]]
    per_token_gb = {k: model.step(k, "gb10", 1)["weight_gb_per_step"] for k in model.cfg["schemes"]}
    spark = [model.step(k, "gb10", b) for k in model.cfg["schemes"] for b in (1, 8)]
    moe = [{"bits": bits, "tokens": t, **model.moe_us("gb10", bits, t)} for bits in (4, 2) for t in (1, 2, 4, 8)]
    for r in moe:
        r["gbps"] = r["bytes"] / r["us"] / 1e3
    return {"prediction": "GB10 predicted from H200 measurements; nothing measured on a Spark",
            "constants": {"h200_ceiling_weights_per_us": issue_ceiling(model.h200, model.cfg),
                          "gb10_ceiling_weights_per_us": issue_ceiling(model.dev("gb10"), model.cfg),
                          "dense_fit": {b: {"fixed_us": a, "weights_per_us": 1 / sl}
                                        for b, (a, sl) in model.dense_fit.items()},
                          "rest_ms": model.rest_ms, "weight_gb_per_token": per_token_gb,
                          "marlin_fit": {"fixed_us": model.marlin_fit[0],
                                         "weights_per_us": 1 / model.marlin_fit[1] if model.marlin_fit[1] else None}},
            "calibration": calib, "dense_fit_max_error": max(dense_err), "spark_steps": spark, "spark_moe": moe,
            "floors": floors(model.cfg),
            "h200_moe_rates": [moe_row_rates(r, model.cfg) for r in model.moe_rows],
            "speculative": {dev: speculative(model, dev) for dev in ("gb10", "h200")}}



# --- other shapes: the bytes floor only ---------------------------------------------------------------------------
def hybrid_step_bytes(f: dict, scheme: dict, batch: int) -> dict[str, float]:
    """Bytes one decode step reads for a model of shape `f` (a [floors.*] entry of spark_model.toml: routed and
    shared experts, gated attention every `full_attention_interval`-th layer, gated delta nets in the others), under
    uniform routing, by part. EXL3 linears carry their fp16 suh/svh; GPTQ's scales are inside its 4.125 bits; the delta
    net's small a/b projection and the routers are 16-bit in both (ExLlamaV3 keeps them so; vLLM's GPTQ leaves the
    routers unquantized)."""
    kind, bits = scheme["kind"], scheme["bits"]

    def linear(k: int, n: int) -> float:
        return k * n * bits / 8 + ((k + n) * 2 if kind == "exl3" else 0)

    h, layers = f["hidden"], f["layers"]
    full = layers // f["full_attention_interval"]
    q = f["q_heads"] * f["head_dim"]
    kv = f["kv_heads"] * f["head_dim"]
    kd, vd = f["linear_k_heads"] * f["linear_k_dim"], f["linear_v_heads"] * f["linear_v_dim"]
    attention = linear(h, q * (2 if f["attn_output_gate"] else 1)) + 2 * linear(h, kv) + linear(q, h)
    delta_net = linear(h, 2 * kd + 2 * vd) + linear(vd, h) + h * 2 * f["linear_v_heads"] * 2
    return {"routed": layers * distinct_experts(batch, f["experts"], f["top_k"])
            * expert_bytes(h, f["expert_width"], bits, kind),
            "shared": layers * expert_bytes(h, f["shared_expert_width"], bits, kind),
            "attention": full * attention, "delta_net": (layers - full) * delta_net,
            "routers": layers * f["experts"] * h * 2, "head": f["vocab"] * h * scheme["head_bits"] / 8}


def floors(cfg: dict) -> list[dict]:
    """Per [floors.*] shape, scheme and batch: GB a decode step reads and the GB10's bytes floor (ms at its
    achievable bandwidth): a lower bound on the step, not the full model (no kernel times of these layers here)."""
    gbps = cfg["devices"]["gb10"]["gbps"]
    out = []
    for name, f in cfg.get("floors", {}).items():
        for key, scheme in cfg["schemes"].items():
            for batch in (1, 8):
                parts = hybrid_step_bytes(f, scheme, batch)
                total = sum(parts.values())
                out.append({"shape": name, "scheme": key, "batch": batch, "gb": total / 1e9,
                            "floor_ms": total / (gbps * 1e6), "tok_s_ceiling": batch * gbps * 1e9 / total,
                            "gb_by_part": {k: v / 1e9 for k, v in parts.items()}})
    return out


def _table(title: str, head: list[str], rows: list[list]) -> list[str]:
    """A markdown section: title, header, one line per row."""
    return ["", f"## {title}", "", "| " + " | ".join(head) + " |", "|" + "---|" * len(head),
            *("| " + " | ".join(str(c) for c in row) + " |" for row in rows)]

def markdown(rep: dict, cfg: dict) -> str:
    c = rep["constants"]
    out = [f"# The Spark, predicted ({rep['prediction']})", "",
           f"Issue ceiling: H200 {c['h200_ceiling_weights_per_us'] / 1e6:.2f} T weights/s, "
           f"GB10 {c['gb10_ceiling_weights_per_us'] / 1e6:.2f}. Fitted on the H200: rest {c['rest_ms']:.3f} ms/step; "
           f"Marlin layer {c['marlin_fit']['fixed_us']:.1f} µs + max(bytes, weights / "
           f"{(c['marlin_fit']['weights_per_us'] or 0) / 1e6:.2f} T/s on the H200); dense call (1 row) "
           f"{c['dense_fit'][1]['fixed_us']:.1f} µs + weights / {c['dense_fit'][1]['weights_per_us'] / 1e6:.2f} T/s, "
           f"largest error of the dense fits (4 layers at each of 1/8/32 rows) {rep['dense_fit_max_error']:.1%}. "
           "Weights per token (GB, heads included): " +
           ", ".join(f"{k} {v:.2f}" for k, v in c["weight_gb_per_token"].items()) + ".", "",
           "## Calibration (H200, end to end)", "",
           "| scheme | batch | measured ms | model ms | error |", "|---|---|---|---|---|"]
    out += [f"| {r['scheme']} | {r['batch']} | {r['measured_ms']:.2f} | {r['model_ms']:.2f} | "
            f"{r['model_ms'] / r['measured_ms'] - 1:+.1%} |" for r in rep["calibration"]]
    out += _table("GB10 decode step (predicted)",
                  ["scheme", "batch", "ms/step", "tok/s", "weights GB/step", "bytes floor ms", "split (ms)"],
                  [[cfg["schemes"][r["scheme"]]["label"], r["batch"], f"{r['ms']:.2f}", f"{r['tok_s']:.0f}",
                    f"{r['weight_gb_per_step']:.2f}", f"{r['floor_ms']:.2f}",
                    ", ".join(f"{k} {v:.2f}" for k, v in r["split_ms"].items())] for r in rep["spark_steps"]])
    out += _table("GB10 MoE layer (predicted)", ["bits", "tokens", "µs", "GB/s", "bytes µs", "issue µs", "bound"],
                  [[r["bits"], r["tokens"], f"{r['us']:.1f}", f"{r['gbps']:.0f}", f"{r['byte_us']:.1f}",
                    f"{r['issue_us']:.1f}", r["bound"]] for r in rep["spark_moe"]])
    out += _table("GB10 bytes floor of other shapes (a lower bound on the step, uniform routing)",
                  ["shape", "scheme", "batch", "GB/step", "floor ms", "tok/s at most", "GB by part"],
                  [[r["shape"], cfg["schemes"][r["scheme"]]["label"], r["batch"], f"{r['gb']:.2f}",
                    f"{r['floor_ms']:.2f}", f"{r['tok_s_ceiling']:.0f}",
                    ", ".join(f"{k} {v:.2f}" for k, v in r["gb_by_part"].items())] for r in rep["floors"]])
    out += _table("H200 MoE rows (measured, or scaled between measured token counts): weights decoded per µs",
                  ["layer", "bits", "tokens", "µs", "distinct experts", "M weights decoded", "M weights/µs",
                   "of issue ceiling", "µs from"],
                  [[r["layer"], r["bits"], r["tokens"], f"{r['us']:.1f}", f"{r['distinct_experts']:.1f}",
                    f"{r['decoded_M']:.0f}", f"{r['weights_per_us'] / 1e6:.2f}", f"{r['ceiling_fraction']:.0%}",
                    r["source"] or "moe_results"]
                   for r in rep["h200_moe_rates"]])
    for dev, name in (("gb10", "GB10"), ("h200", "H200")):
        out += speculative_markdown(rep["speculative"][dev], cfg, name)
    return "\n".join(out)


def speculative_markdown(spec: dict, cfg: dict, name: str) -> list[str]:
    """The speculative-decoding tables of one device: the verify and draft costs, then tok/s per acceptance rate."""
    sp, label = cfg["speculative"], lambda k: cfg["schemes"][k]["label"]
    drafts = {(d["scheme"], d["method"]): d for d in spec["drafts"]}
    out = _table(f"{name} verify step of one sequence, k draft tokens (predicted): ms, k + 1 rows",
                 ["scheme", "plain (k = 0)", *(f"k = {n}" for n in sp["draft_tokens"]), "mtp draft ms/token",
                  "mtp draft split (ms)"],
                 [[label(k), f"{p['ms']:.2f}",
                   *(f"{v['ms']:.2f}" for v in spec["verify_steps"] if v["scheme"] == k),
                   f"{drafts[k, 'mtp']['ms']:.2f}",
                   ", ".join(f"{c} {v:.2f}" for c, v in drafts[k, "mtp"]["split_ms"].items())]
                  for k, p in spec["plain"].items()])
    out += _table(f"{name} speculative decoding, one sequence (predicted): tok/s (× plain) at acceptance a",
                  ["scheme", "plain tok/s", "method", "k", "step ms (verify + drafts)",
                   *(f"a = {a}" for a in sp["acceptance"]), "break-even a"],
                  [[label(r["scheme"]), f"{spec['plain'][r['scheme']]['tok_s']:.0f}", r["method"], r["k"],
                    f"{r['step_ms']:.2f}",
                    *(f"{x['tok_s']:.0f} ({x['speedup']:.2f}×)" for x in r["at"].values()),
                    "never" if r["break_even"] is None else f"{r['break_even']:.2f}"] for r in spec["rows"]])
    return out


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--json", type=Path, help="write the report as JSON here")
    ap.add_argument("--gbps", type=float, help="GB10 achievable bandwidth (default from the TOML)")
    ap.add_argument("--clock", type=float, help="GB10 SM clock in GHz (default from the TOML)")
    a = ap.parse_args(argv)
    cfg = load_config()
    if a.gbps:
        cfg["devices"]["gb10"]["gbps"] = cfg["devices"]["gb10"]["cublas_gbps"] = a.gbps
    if a.clock:
        cfg["devices"]["gb10"]["clock_ghz"] = a.clock
    rep = report(Model(cfg))
    print(markdown(rep, cfg))
    if a.json:
        a.json.write_text(json.dumps(rep, indent=1, default=str) + "\n")


if __name__ == "__main__":
    main()
