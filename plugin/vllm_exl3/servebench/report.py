"""The report of a run, from its raw JSON alone (so a saved run can be rendered again): the per-category table,
the per-concurrency table with the server's own numbers beside the client's, and the one-line summary."""

from __future__ import annotations

from . import stats


def _f(x: float | None, digits: int = 1) -> str:
    return "–" if x is None else f"{x:,.{digits}f}"


def _x(ratio: float | None) -> str:
    return "–" if ratio is None else f"{ratio:.2f}×"


def phases(report: dict, side: str) -> dict[int, dict]:
    """concurrency -> phase, for one side (the concurrency phases; the prefill phase is prefill_phases')."""
    return {p["concurrency"]: p for p in report["phases"] if p["side"] == side and "prefill_length" not in p}


def prefill_phases(report: dict) -> list[dict]:
    return sorted((p for p in report["phases"] if "prefill_length" in p),
                  key=lambda p: (p["prefill_length"], p["side"]))


def summary(phase: dict) -> dict:
    """The phase's numbers, derived again from its raw requests (a saved run renders with the current rules)."""
    return stats.summarize(phase["requests"], phase["wall_s"])


def first_level(report: dict) -> int | None:
    """The lowest concurrency measured on every side: the per-category table's level (one request at a time, where
    there is one, shows each side's decode speed unmixed)."""
    levels = [set(phases(report, s)) for s in report["sides"]]
    common = set.intersection(*levels) if levels else set()
    return min(common) if common else None


def by_category(report: dict, side: str, concurrency: int) -> dict[str, dict]:
    phase = phases(report, side).get(concurrency)
    if not phase:
        return {}
    out = {}
    for cat in report["workload"]["categories"]:
        reqs = [r for r in phase["requests"] if r["category"] == cat]
        if reqs:
            out[cat] = stats.summarize(reqs)
    return out


def _side_line(name: str, s: dict) -> str:
    if not s.get("reached"):
        return f"- **{name}** `{s['label']}`: {s['url']}, not reached"
    backends = s["backends"]
    if isinstance(backends, dict):
        backends = ", ".join(f"{layer}: {'/'.join(b)}" for layer, b in backends.items())
    return (f"- **{name}** `{s['label']}`: {s['url']}, model `{s['model']}`, backends: {backends}, GPU: {s['gpu']}"
            + ("" if s["vllm_metrics"] else ", no vLLM metrics (server-side columns empty, ignore_eos not sent)"))


def _server(report: dict, side: str, concurrency: int, category: str | None) -> dict:
    """The server's account of one category (one request at a time) or of the whole phase (category None)."""
    phase = phases(report, side)[concurrency]
    if category is None:
        return phase.get("server") or {}
    return (phase.get("server_by_category") or {}).get(category) or {}


def category_table(report: dict) -> list[str]:
    c = first_level(report)
    names = list(report["sides"])
    if c is None:
        return ["(no phase measured on every side)"]
    cats = {s: by_category(report, s, c) for s in names}
    rows = [c_ for c_ in report["workload"]["categories"] if all(c_ in cats[s] for s in names)]
    client = {s: {cat: cats[s][cat] for cat in rows} for s in names}
    for s in names:
        client[s][None] = summary(phases(report, s)[c])  # the **all** row
    label = {cat: cat for cat in rows} | {None: "**all**"}
    intro = (f"Per category, concurrency {c}. Client: decode tok/s (tokens after the first over the time after it) "
             "and mean TTFT; server: mean ms per decode step and decode tok/s from its /metrics.")
    if len(names) == 2:
        a, b = names
        lines = [intro, "",
                 (f"| category | {a} tok/s | {b} tok/s | {a} TTFT ms | {b} TTFT ms | speedup ({b}/{a}) | "
                  f"{a} server ms/step | {b} server ms/step | server speedup ({b}/{a}) |"),
                 "|---|---:|---:|---:|---:|---:|---:|---:|---:|"]
        for cat in [*rows, None][: len(rows) + (1 if rows else 0)]:
            ra, rb = client[a][cat], client[b][cat]
            sa, sb = _server(report, a, c, cat), _server(report, b, c, cat)
            lines.append(f"| {label[cat]} | {_f(ra['decode_tok_s'])} | {_f(rb['decode_tok_s'])} | "
                         f"{_f(ra['ttft_ms'])} | {_f(rb['ttft_ms'])} | "
                         f"{_x(stats.speedup(ra['decode_tok_s'], rb['decode_tok_s']))} | "
                         f"{_f(sa.get('ms_per_step'), 2)} | {_f(sb.get('ms_per_step'), 2)} | "
                         f"{_x(stats.speedup(sa.get('decode_tokens_per_s'), sb.get('decode_tokens_per_s')))} |")
        return lines
    (a,) = names
    lines = [intro, "", ("| category | tok/s | TTFT ms | ITL p50 ms | ITL p99 ms | E2E ms | server ms/step | "
                         "server tok/s |"), "|---|---:|---:|---:|---:|---:|---:|---:|"]
    for cat in [*rows, None][: len(rows) + (1 if rows else 0)]:
        r, srv = client[a][cat], _server(report, a, c, cat)
        lines.append(f"| {label[cat]} | {_f(r['decode_tok_s'])} | {_f(r['ttft_ms'])} | "
                     f"{_f(r['itl_ms_pct']['p50'], 2)} | {_f(r['itl_ms_pct']['p99'], 2)} | {_f(r['e2e_ms'])} | "
                     f"{_f(srv.get('ms_per_step'), 2)} | {_f(srv.get('decode_tokens_per_s'))} |")
    return lines


def notes(report: dict) -> list[str]:
    """What a reader must know to trust the tables: requests cut short, and phases where the client's timing
    disagrees with the server's."""
    out = []
    for side in report["sides"]:
        mine = [p for p in report["phases"] if p["side"] == side]
        short = [r for p in mine for r in p["requests"] if r.get("ok") and r["tokens"] < r["max_tokens"]]
        if short:
            r = short[0]
            out.append(f"- {side}: {len(short)} request(s) got fewer tokens than asked (e.g. {r['category']} "
                       f"#{r['index']}: {r['tokens']} of {r['max_tokens']}, finish_reason {r['finish_reason']}, "
                       f"{r['prompt_tokens']} prompt tokens): the server ended them early (a full context, or "
                       "ignore_eos not honoured)")
        for p in mine:
            client, server = summary(p)["decode_tok_s"], (p.get("server") or {}).get("decode_tokens_per_s")
            if client and server and abs(client / server - 1) > stats.AGREEMENT:
                out.append(f"- {side}, concurrency {p['concurrency']}: the client measured {_f(client)} tok/s per "
                           f"request, the server {_f(server)}: tokens reached the client unevenly (a busy client "
                           "machine, a proxy or the network), so compare the server's columns")
    return ["Notes:", "", *out] if out else []


def concurrency_table(report: dict) -> list[str]:
    if not report["phases"]:
        return ["(nothing measured)"]
    lines = ["Per concurrency level (client: all requests of the phase; server: its /metrics before and after):", "",
             ("| side | concurrency | requests | tok/s (all) | tok/s per request | TTFT p50 / p99 ms | "
              "ITL p50 / p90 / p99 ms | E2E p50 ms | server tok/s | server ms/step | server tok/s per request | "
              "server tokens/step | tokens: received / server |"),
             "|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for p in sorted((p for p in report["phases"] if "prefill_length" not in p),
                    key=lambda p: (p["concurrency"], p["side"])):
        s, srv = summary(p), p.get("server") or {}
        itl, ttft = s["itl_ms_pct"], s["ttft_ms_pct"]
        lines.append(
            f"| {p['side']}{' (incomplete)' if p.get('incomplete') else ''} | {p['concurrency']} | "
            f"{s['requests'] - s['failed']}/{s['requests']} | {_f(s['aggregate_tok_s'])} | {_f(s['decode_tok_s'])} | "
            f"{_f(ttft['p50'])} / {_f(ttft['p99'])} | {_f(itl['p50'], 2)} / {_f(itl['p90'], 2)} / "
            f"{_f(itl['p99'], 2)} | {_f(s['e2e_ms_pct']['p50'])} | {_f(srv.get('tokens_per_s'))} | "
            f"{_f(srv.get('ms_per_step'), 2)} | {_f(srv.get('decode_tokens_per_s'))} | "
            f"{_f(srv.get('tokens_per_step'), 2)} | "
            f"{s['tokens']} / {srv.get('generation_tokens', '–')} |")
    return lines


def prefill_table(report: dict) -> list[str]:
    """The prefill phase: long prompts one at a time; the server's prefill rate is what to compare."""
    rows = prefill_phases(report)
    if not rows:
        return []
    lines = ["Prefill (one long prompt at a time, token ids, a few output tokens; server: prompt tokens over the "
             "engine's prefill time):", "",
             "| side | prompt tokens | requests | server prefill tok/s | server TTFT ms | client TTFT p50 ms |",
             "|---|---:|---:|---:|---:|---:|"]
    for p in rows:
        s, srv = summary(p), p.get("server") or {}
        lines.append(f"| {p['side']}{' (incomplete)' if p.get('incomplete') else ''} | {p['prefill_length']} | "
                     f"{s['requests'] - s['failed']}/{s['requests']} | {_f(srv.get('prefill_tokens_per_s'), 0)} | "
                     f"{_f(srv.get('ttft_ms'))} | {_f(s['ttft_ms_pct']['p50'])} |")
    return lines


def summary_line(report: dict) -> str:
    c = first_level(report)
    names = list(report["sides"])
    prefix = "PARTIAL " if report["partial"] else ""
    if c is None:
        return f"{prefix}bench: nothing measured" + (f" ({report['error']})" if report["error"] else "")
    mean = {s: summary(phases(report, s)[c]) for s in names}
    srv = {s: _server(report, s, c, None).get("decode_tokens_per_s") for s in names}
    step = {s: _server(report, s, c, None).get("ms_per_step") for s in names}
    # The server's counters lead (its own clock); the client's numbers follow in brackets.
    parts = [(f"{s} server {_f(step[s], 2)} ms/step, {_f(srv[s])} tok/s (client {_f(mean[s]['decode_tok_s'])})"
              if srv[s] and step[s] else f"{s} {_f(mean[s]['decode_tok_s'])} tok/s (client; no server metrics)")
             + f", TTFT {_f(mean[s]['ttft_ms'], 0)} ms" for s in names]
    line = f"{prefix}bench at concurrency {c}, all categories: " + "; ".join(parts)
    if len(names) == 2:
        a, b = names
        client = _x(stats.speedup(mean[a]['decode_tok_s'], mean[b]['decode_tok_s']))
        line += (f"; {b}/{a} decode speedup {_x(stats.speedup(srv[a], srv[b]))} (client {client})"
                 if srv[a] and srv[b] else f"; {b}/{a} decode speedup {client} (client)")
    rates = [(summary(p)["aggregate_tok_s"], p) for p in report["phases"]]
    rate, top = max(((r, p) for r, p in rates if r), default=(None, None), key=lambda rp: rp[0])
    if top and top["concurrency"] != c:
        line += f"; peak {_f(rate)} tok/s ({top['side']}, concurrency {top['concurrency']})"
    return line


def markdown(report: dict, title: str | None = None) -> str:
    w = report["workload"]
    lengths = (f"{w['max_tokens']} output tokens each" if w["max_tokens"] else "each category's own output length")
    lines = [f"# {title or 'vllm-exl3 bench'}", ""]
    if report["partial"]:
        lines += [f"**PARTIAL REPORT: the run stopped early: {report['error']}**", ""]
    lines += [f"{report['tool']}, started {report['started']} on {report['client']}.", ""]
    lines += [_side_line(n, s) for n, s in report["sides"].items()]
    lines += ["", (f"Workload: {len(w['categories'])} categories × {w['prompts_per_category']} prompt(s), {lengths}, "
              f"`/v1/{'chat/completions' if w['api'] == 'chat' else 'completions'}` streaming, temperature "
              f"{w['temperature']:g}, seed {w['seed']}, ignore_eos {'on' if w['ignore_eos'] else 'off'}, "
              f"concurrency {', '.join(map(str, w['concurrency']))}, {w['warmup']} warm-up request(s) per side "
              "not measured; each phase starts on an idle server."), ""]
    lines += category_table(report) + [""] + concurrency_table(report) + [""]
    if prefill := prefill_table(report):
        lines += prefill + [""]
    remarks = notes(report)
    lines += remarks + ([""] if remarks else []) + [summary_line(report), ""]
    return "\n".join(lines)
