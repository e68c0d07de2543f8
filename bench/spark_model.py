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

    def dense_us(self, dev: str, weights: float, nbytes: float, rows: int) -> float:
        a, s = self.dense_fit[rows]
        return a + max(nbytes / (self.dev(dev)["gbps"] * 1e3), weights * s * self.speed(dev))

    def step(self, scheme: str, dev: str, batch: int) -> dict:
        """ms per decode step of the whole model, split by kernel class."""
        m, sc, d = self.m, self.cfg["schemes"][scheme], self.dev(dev)
        plain = lambda nbytes: nbytes / (d["cublas_gbps"] * 1e3)  # noqa: E731  (µs)
        layers, head_w = m["layers"], m["vocab"] * m["hidden"]
        us, nbytes = {}, {}
        if sc["kind"] == "exl3":
            moe = self.moe_us(dev, sc["bits"], batch)
            us["moe"], nbytes["moe"] = layers * moe["us"], layers * moe["bytes"]
            calls = dense_calls(m, batch, self.cfg["serving"]["grouped_max_rows"])
            dense = [(sum(k * n for k, n in call), sum(k * n * sc["bits"] / 8 + (k + n) * 2 for k, n in call))
                     for call in calls]
            us["dense"] = layers * sum(self.dense_us(dev, w, b, batch) for w, b in dense)
            nbytes["dense"] = layers * sum(b for _, b in dense)
        else:
            nbytes["moe+dense"] = layers * self.gptq_layer(batch, sc["bits"])[1]
            us["moe+dense"] = layers * self.marlin_us(dev, batch, sc["bits"])
        nbytes["head"] = head_w * sc["head_bits"] / 8
        us["head"] = (plain(nbytes["head"]) if sc["head_bits"] == 16 else
                      self.dense_us(dev, head_w, nbytes["head"] + (m["vocab"] + m["hidden"]) * 2, batch))
        nbytes["router"] = layers * m["experts"] * m["hidden"] * 2
        nbytes["kv"] = batch * m["context"] * layers * 2 * m["kv_heads"] * m["head_dim"] * m["kv_bytes"]
        us["router+kv"] = plain(nbytes["router"] + nbytes["kv"])
        us["rest"] = self.rest_ms * 1e3
        ms = sum(us.values()) / 1e3
        return {"scheme": scheme, "device": dev, "batch": batch, "ms": ms, "tok_s": batch * 1e3 / ms,
                "weight_gb_per_step": sum(v for k, v in nbytes.items() if k != "kv") / 1e9,
                "floor_ms": sum(nbytes.values()) / (d["gbps"] * 1e6),
                "split_ms": {k: v / 1e3 for k, v in us.items()}}


def _interp_log2(x: float, pts: list[tuple[int, float]]) -> float:
    for (x0, y0), (x1, y1) in zip(pts, pts[1:]):
        if x0 <= x <= x1:
            f = (math.log2(x) - math.log2(x0)) / (math.log2(x1) - math.log2(x0))
            return y0 + f * (y1 - y0)
    raise ValueError(f"{x} tokens is outside the measured {pts[0][0]}..{pts[-1][0]}")


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
            "h200_moe_rates": [moe_row_rates(r, model.cfg) for r in model.moe_rows]}



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
    return "\n".join(out)


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
