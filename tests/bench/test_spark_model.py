"""bench/spark_model.py: the H200-calibrated per-kernel model that predicts the DGX Spark (CPU only, reads only the
repo's committed result files and bench/spark_model.toml)."""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("spark_model", ROOT / "bench" / "spark_model.py")
sm = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(sm)


@pytest.fixture(scope="module")
def model():
    return sm.Model(sm.load_config())


def test_end_to_end_calibration_points_are_reproduced(model):
    s = model.cfg["serving"]
    for scheme, key in ((s["exl3_scheme"], "exl3_4bit_ms"), ("gptq_4bit", "gptq_4bit_ms")):
        for batch, measured in zip(s["batches"], s[key]):
            predicted = model.step(scheme, "h200", batch)["ms"]
            assert abs(predicted / measured - 1) < 0.06, (scheme, batch, predicted, measured)


def test_moe_and_dense_calibration_rows(model):
    fixed = model.cfg["calibration"]["moe_fixed_us"]
    for (bits, tokens), measured in model.moe_h200.items():
        r = model.moe_us("h200", bits, tokens)
        assert r["us"] == pytest.approx(measured, rel=1e-9)
        assert r["bound"] == "issue" and r["byte_us"] < r["issue_us"]  # the H200 never waits on bytes here
        assert measured > fixed
    for rows, (a, slope) in model.dense_fit.items():
        assert a > 0 and slope > 0
        for weights, us in model.dense_points[rows]:
            assert abs(a + slope * weights - us) / us < 0.15, (rows, weights, us)
    assert model.rest_ms > 0 and model.marlin_fit[0] > 0 and model.marlin_fit[1] > 0


def test_two_bit_reads_half_the_expert_bytes_of_four_bit(model):
    h, w = model.m["hidden"], model.m["expert_width"]
    scales = 3 * (h + w) * 2
    assert sm.expert_bytes(h, w, 2.0) - scales == pytest.approx((sm.expert_bytes(h, w, 4.0) - scales) / 2)
    for tokens in (1, 2, 4, 8):
        b4, b2 = model.moe_us("gb10", 4, tokens)["bytes"], model.moe_us("gb10", 2, tokens)["bytes"]
        assert 0.5 < b2 / b4 < 0.51


def test_gb10_is_bandwidth_bound_where_bytes_dominate(model):
    ratio = model.speed("gb10")
    dev = model.cfg["devices"]
    expect = (dev["h200"]["sms"] * dev["h200"]["clock_ghz"]) / (dev["gb10"]["sms"] * dev["gb10"]["clock_ghz"])
    assert ratio == pytest.approx(expect) and ratio > 1  # the GB10 issues fewer instructions per µs
    for tokens in (1, 2, 4, 8):
        r4 = model.moe_us("gb10", 4, tokens)
        assert r4["bound"] == "bytes" and r4["byte_us"] > r4["issue_us"]
        assert r4["us"] >= r4["bytes"] / (dev["gb10"]["gbps"] * 1e3)  # never faster than the bandwidth
        r2 = model.moe_us("gb10", 2, tokens)
        assert r2["us"] < r4["us"]  # fewer bytes: 2 bits beat 4 on the Spark (they tie on the H200)
        fixed = model.cfg["calibration"]["moe_fixed_us"]
        assert r2["us"] == pytest.approx(fixed + max(r2["byte_us"], r2["issue_us"]))
    steps = {(k, b): model.step(k, "gb10", b) for k in model.cfg["schemes"] for b in (1, 8)}
    for r in steps.values():
        assert r["ms"] >= r["floor_ms"]
    assert steps["exl3_2bit", 1]["ms"] < steps["exl3_4bit", 1]["ms"] < steps["exl3_4bit_fp16_head", 1]["ms"]


def test_bytes_per_token(model):
    gb = {k: model.step(k, "gb10", 1)["weight_gb_per_step"] for k in model.cfg["schemes"]}
    assert gb["gptq_4bit"] == pytest.approx(2.05, abs=0.01)  # the numbers, recomputed from the shape
    assert gb["exl3_4bit"] == pytest.approx(1.62, abs=0.01)


def test_routing_and_decode_counts():
    assert sm.distinct_experts(1, 128, 8) == pytest.approx(8)
    assert sm.distinct_experts(8, 128, 8) == pytest.approx(128 * (1 - (15 / 16) ** 8))
    for tokens in (1, 2, 8):  # at most 8 rows per expert: one chunk per routed expert
        assert sm.expert_decodes(tokens, 128, 8) == pytest.approx(sm.distinct_experts(tokens, 128, 8), rel=1e-9)
    assert sm.expert_decodes(4096, 128, 8) > 4 * 128  # four 1024-token steps, some experts in two 64-row chunks
    assert [sm.rows_per_chunk(p, 128) for p in (8, 1024, 2048, 8192)] == [8, 8, 16, 64]


def test_moe_row_rates(model):
    cfg = model.cfg
    row = {"layer": "qwen3-30b-a3b", "bits": 4, "tokens": 1, "native_graph_us": 20.0,
           "routed_bytes": 8 * sm.expert_bytes(2048, 768, 4)}
    r = sm.moe_row_rates(row, cfg)
    assert r["distinct_experts"] == pytest.approx(8)
    assert r["weights_per_us"] == pytest.approx(8 * 3 * 2048 * 768 / 20.0)
    h = cfg["devices"]["h200"]
    ipw = cfg["calibration"]["warp_instructions_per_weight"]
    ceiling = h["sms"] * h["schedulers_per_sm"] * h["clock_ghz"] * 1e3 / ipw
    assert r["ceiling_fraction"] == pytest.approx(r["weights_per_us"] / ceiling)
    assert all(0 < x["ceiling_fraction"] < 1 for x in sm.report(model)["h200_moe_rates"])


def test_cli_prints_markdown_and_writes_json(tmp_path):
    out = tmp_path / "spark.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "spark_model.py"), "--json", str(out), "--gbps", "208"],
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "predicted" in r.stdout and "| EXL3 2.0 bpw" in r.stdout
    rep = json.loads(out.read_text())
    assert {"calibration", "spark_steps", "spark_moe", "h200_moe_rates"} <= rep.keys()
    assert all(m["gbps"] <= 208 + 1e-9 for m in rep["spark_moe"])
    assert all(math.isfinite(s["ms"]) for s in rep["spark_steps"])


def test_moe_rows_scale_the_sweep_between_the_later_run_s_token_counts(tmp_path):
    """Measured rows of the later run replace the sweep's; between two of them the sweep's row is scaled by the
    ratio interpolated over log2(tokens); outside them a row is left out, not extrapolated."""
    def rows(points):
        return {"rows": [{"layer": "qwen3-30b-a3b", "bits": 4, "tokens": t, "native_graph_us": us}
                         for t, us in points]}
    (tmp_path / "sweep.json").write_text(json.dumps(rows([(1, 10.0), (2, 20.0), (8, 40.0), (64, 80.0)])))
    (tmp_path / "now.json").write_text(json.dumps(rows([(1, 5.0), (8, 30.0)])))
    out = sm.moe_rows({"moe_results": str(tmp_path / "sweep.json"), "moe_current": str(tmp_path / "now.json")})
    got = {r["tokens"]: (r["native_graph_us"], r["source"]) for r in out}
    ratio_2 = 0.5 + (0.75 - 0.5) * (1 / 3)  # log2(2) is a third of the way from log2(1) to log2(8)
    assert got == {1: (5.0, "current"), 2: (pytest.approx(20.0 * ratio_2), "scaled"), 8: (30.0, "current")}
    assert sm.moe_rows({"moe_results": str(tmp_path / "sweep.json")})[3]["native_graph_us"] == 80.0


def test_bytes_floor_of_a_hybrid_shape():
    """sm.floors: the Qwen3-Next shape's step reads its parts, the delta nets only in the layers that are not
    full attention, the routed experts of the distinct experts a batch routes to; 2 bits read half the weights."""
    cfg = sm.load_config()
    f = cfg["floors"]["qwen3-next-80b-a3b"]
    four, two = cfg["schemes"]["exl3_4bit"], cfg["schemes"]["exl3_2bit"]
    one, eight = (sm.hybrid_step_bytes(f, four, b) for b in (1, 8))
    ratio = sm.distinct_experts(8, f["experts"], f["top_k"]) / sm.distinct_experts(
        1, f["experts"], f["top_k"])
    assert eight["routed"] == pytest.approx(one["routed"] * ratio)
    assert {k: v for k, v in eight.items() if k != "routed"} == {k: v for k, v in one.items() if k != "routed"}
    half = sm.hybrid_step_bytes(f, two, 1)
    weights = f["top_k"] * 3 * f["hidden"] * f["expert_width"] * f["layers"]
    assert one["routed"] - half["routed"] == pytest.approx(weights * (4 - 2) / 8)
    assert sm.hybrid_step_bytes({**f, "full_attention_interval": 1}, four, 1)["delta_net"] == 0
    rows = [r for r in sm.floors(cfg) if r["scheme"] == "exl3_4bit"]
    for r in rows:
        assert r["gb"] == pytest.approx(sum(r["gb_by_part"].values()))
        assert r["floor_ms"] == pytest.approx(r["gb"] / cfg["devices"]["gb10"]["gbps"] * 1e3)
        assert r["tok_s_ceiling"] == pytest.approx(r["batch"] * 1e3 / r["floor_ms"])


# --- speculative decoding (issue #45) -----------------------------------------------------------------------------
def test_existing_predictions_are_unchanged(model):
    """The GB10 steps bench/notes/spark-model.md "The Spark, predicted" prints (ms at batch 1 / 8): the verify-step
    code shares their functions and must not move them."""
    notes = {"exl3_4bit": (9.90, 31.59), "exl3_2bit": (7.54, 18.19), "exl3_4bit_fp16_head": (11.54, 33.23),
             "gptq_4bit": (12.92, 34.89)}
    for scheme, ms in notes.items():
        for batch, expect in zip((1, 8), ms):
            r = model.step(scheme, "gb10", batch)
            assert r["ms"] == pytest.approx(expect, abs=0.005), (scheme, batch)
            assert model.step(scheme, "gb10", batch, seqs=batch) == r  # one sequence per row by default


def test_tokens_per_step_is_the_iid_acceptance_formula():
    for k in range(6):
        assert sm.tokens_per_step(0.0, k) == 1.0  # nothing accepted: the target's own token
        assert sm.tokens_per_step(1.0, k) == k + 1
        for a in (0.3, 0.5, 0.7, 0.9):
            assert sm.tokens_per_step(a, k) == pytest.approx(sum(a ** i for i in range(k + 1)))
    assert sm.tokens_per_step(0.5, 1) == pytest.approx(1.5)
    assert sm.tokens_per_step(0.7, 3) == pytest.approx(1 + 0.7 + 0.49 + 0.343)
    grid = [i / 100 for i in range(100)]
    for k in range(1, 5):
        values = [sm.tokens_per_step(a, k) for a in grid]
        assert all(x < y for x, y in itertools.pairwise(values))


def test_break_even_solves_the_equation():
    for k in range(1, 5):
        for ratio in (1.1, 1.5, k + 0.5):
            a = sm.break_even(k, ratio)
            assert 0 < a < 1 and sm.tokens_per_step(a, k) == pytest.approx(ratio, rel=1e-9)
        assert sm.break_even(k, 1.0) == 0.0  # a step that costs no more than the plain one pays at once
        assert sm.break_even(k, k + 1) is None  # k + 1 times the plain step never pays


def test_dense_fit_at_k_plus_one_rows(model):
    """At a fitted row count the interpolated fit is the fit; between two (2-5 rows lie between 1 and 8) each
    coefficient is linear in log2(rows)."""
    for rows, fit in model.dense_fit.items():
        assert model.dense_coef(rows) == fit
    (a1, s1), (a8, s8) = model.dense_fit[1], model.dense_fit[8]
    for rows in (2, 3, 4, 5):
        f = math.log2(rows) / 3
        a, s = model.dense_coef(rows)
        assert a == pytest.approx(a1 + f * (a8 - a1)) and s == pytest.approx(s1 + f * (s8 - s1))
        assert min(a1, a8) <= a <= max(a1, a8) and min(s1, s8) <= s <= max(s1, s8)
    with pytest.raises(ValueError):
        model.dense_coef(64)  # beyond the fitted rows: not extrapolated
    for scheme in ("exl3_4bit", "gptq_4bit"):  # k = 7 is 8 rows: the measured fit, only the KV cache is one sequence
        v, b8 = model.verify_step(scheme, "gb10", 7), model.step(scheme, "gb10", 8)
        assert {k: x for k, x in v["split_ms"].items() if k != "router+kv"} == {
            k: x for k, x in b8["split_ms"].items() if k != "router+kv"}
        assert v["split_ms"]["router+kv"] < b8["split_ms"]["router+kv"]


def test_verify_step_grows_with_k(model):
    for dev in ("gb10", "h200"):
        for scheme in model.cfg["speculative"]["schemes"]:
            plain = model.step(scheme, dev, 1)
            assert model.verify_step(scheme, dev, 0)["ms"] == pytest.approx(plain["ms"], rel=1e-12)
            ms = [model.verify_step(scheme, dev, k)["ms"] for k in range(5)]
            assert all(x < y for x, y in itertools.pairwise(ms)), (dev, scheme, ms)
            kv1 = model.step(scheme, dev, 1)["split_ms"]["router+kv"]
            assert model.verify_step(scheme, dev, 4)["split_ms"]["router+kv"] == pytest.approx(kv1)


def test_draft_costs(model):
    for dev in ("gb10", "h200"):
        for scheme in model.cfg["speculative"]["schemes"]:
            assert model.draft(scheme, dev, "ngram")["ms"] == 0.0
            mtp = model.draft(scheme, dev, "mtp")
            sc = model.cfg["schemes"][scheme]
            head, _ = model.head_us(sc, dev, 1)
            assert mtp["split_ms"]["head"] == pytest.approx(head / 1e3)  # the shared lm_head at one row
            assert mtp["split_ms"]["rest"] == pytest.approx(model.rest_ms / model.m["layers"])
            plain = model.step(scheme, dev, 1)
            if sc["bits"] == mtp["bits"]:  # an MTP layer of the trunk's shape and bits: one trunk layer's classes
                for part in ("moe", "dense", "moe+dense"):
                    if part in plain["split_ms"]:
                        assert mtp["split_ms"][part] == pytest.approx(plain["split_ms"][part] / model.m["layers"])
            assert mtp["split_ms"]["eh_proj"] > 0 and mtp["ms"] < plain["ms"]
    assert model.draft("exl3_2bit", "gb10", "mtp")["bits"] == 4.0  # ExLlamaV3's --mtp_bits default
    with pytest.raises(ValueError):
        model.draft("exl3_4bit", "gb10", "eagle3")


@pytest.mark.parametrize("dev", ["gb10", "h200"])
def test_speculative_table(model, dev):
    spec = sm.speculative(model, dev)
    sp = model.cfg["speculative"]
    assert len(spec["rows"]) == len(sp["schemes"]) * len(sp["methods"]) * len(sp["draft_tokens"])
    for r in spec["rows"]:
        plain = spec["plain"][r["scheme"]]
        tok_s = [x["tok_s"] for x in r["at"].values()]
        assert all(x < y for x, y in itertools.pairwise(tok_s))  # grows with the acceptance rate
        for a, x in zip(sp["acceptance"], r["at"].values()):
            assert x["tok_s"] == pytest.approx(sm.tokens_per_step(a, r["k"]) * 1e3 / r["step_ms"])
            assert x["speedup"] == pytest.approx(x["tok_s"] / plain["tok_s"])
        assert 0 < r["break_even"] < 1
        at_break_even = sm.tokens_per_step(r["break_even"], r["k"]) * 1e3 / r["step_ms"]
        assert at_break_even == pytest.approx(plain["tok_s"], rel=1e-9)
    by = {(r["scheme"], r["method"], r["k"]): r for r in spec["rows"]}
    for scheme in sp["schemes"]:
        for k in sp["draft_tokens"]:  # free drafts pay sooner than MTP's
            assert by[scheme, "ngram", k]["break_even"] < by[scheme, "mtp", k]["break_even"]
            assert by[scheme, "ngram", k]["step_ms"] == pytest.approx(by[scheme, "ngram", k]["verify_ms"])


def test_cli_reports_speculative(tmp_path):
    out = tmp_path / "spark.json"
    r = subprocess.run([sys.executable, str(ROOT / "bench" / "spark_model.py"), "--json", str(out)],
                       check=False, capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert "## GB10 speculative decoding" in r.stdout and "## H200 verify step" in r.stdout
    rep = json.loads(out.read_text())
    assert set(rep["speculative"]) == {"gb10", "h200"}
    assert all(0 < row["break_even"] < 1 for row in rep["speculative"]["gb10"]["rows"])
